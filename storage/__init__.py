"""storage: generation results → the Parquet product the user trains on.

Follow a row: ``schema`` (the columns, ``rows_to_table``) and ``spans`` (where reasoning, answer and
tool calls are, from the ids) → ``writer`` (one atomic part per group commit) under ``layout``'s
paths → ``reader`` (the committed view: each prompt once). Around it: ``manifest`` (the submitted set
beside the data), ``verify``/``checks`` (is everything there, once, and sound), ``exports`` (EAGLE-3
records, conversations: one module per format), ``report``, ``compact``, and ``cli`` (their click commands).
"""

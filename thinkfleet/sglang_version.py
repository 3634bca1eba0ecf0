"""The SGLang release thinkfleet deploys: one constant, read by everything that must agree with it.

``docker-compose.yml`` (and ``.env.example``) pin the image ``lmsysorg/sglang:v{SGLANG_VERSION}``
(tests/test_sim_versions.py checks every compose file against this constant); the simulator imitates
this release unless started with ``--sglang-version``; docs/sglang-versions.md lists what differs
between it and the newer releases. Change the three together.
"""

from __future__ import annotations

#: The deployed SGLang release (the compose image tag without its leading "v").
SGLANG_VERSION = "0.5.9"
#: The image the compose file runs.
SGLANG_IMAGE = f"lmsysorg/sglang:v{SGLANG_VERSION}"

"""The parts a job has: its committed part files as every reader sees them — a part a compacted file replaces left
out, a compacted part whose footer is damaged moved aside (storage/quarantine.py) and the parts it listed live again.

Paths and names are storage/layout.py's; moving a damaged part aside is storage/quarantine.py's; this module stands
on both (the listing needs the quarantine, the quarantine only the layout: the arrows run one way).
"""

from __future__ import annotations

import posixpath

import pyarrow.fs as pafs

from storage import layout, quarantine


def list_parts(
    loc: layout.Location, job: str, datasets: list[str] | None = None, *, include_superseded: bool = False
) -> list[pafs.FileInfo]:
    """Committed part files of a job (optionally of some datasets), sorted by path.

    Parts that a compacted file already replaces (compaction interrupted before it deleted them)
    are left out unless ``include_superseded``: their rows are in the compacted file.
    """
    selectors = [loc.job_dir(job)] if datasets is None else [loc.dataset_dir(job, d) for d in datasets]
    found: list[pafs.FileInfo] = []
    for base in selectors:
        infos = loc.fs.get_file_info(pafs.FileSelector(base, allow_not_found=True, recursive=True))
        for info in infos:
            if info.type != pafs.FileType.File or not layout.is_part_name(info.base_name):
                continue
            parent = posixpath.dirname(info.path)
            # Exactly {job}/dataset=…/part-*: nothing deeper, nothing in _manifest.
            if posixpath.dirname(parent) != loc.job_dir(job):
                continue
            if layout.dataset_from_dir(posixpath.basename(parent)) is None:
                continue
            found.append(info)
    found.sort(key=lambda i: i.path)
    replaced, damaged = _superseded(loc, found)
    gone = damaged if include_superseded else replaced | damaged
    return [i for i in found if i.path not in gone]


def dataset_names(loc: layout.Location, job: str) -> list[str]:
    """Datasets of a job that have at least one committed part."""
    names = {layout.dataset_from_dir(posixpath.basename(posixpath.dirname(p.path))) for p in list_parts(loc, job)}
    return sorted(n for n in names if n)


def superseded(loc: layout.Location, parts: list[pafs.FileInfo]) -> set[str]:
    """Paths among ``parts`` that a compacted part in the same directory replaces.

    A compacted part whose footer is damaged replaces nothing: it is quarantined (storage/quarantine.py), and
    the parts it listed, where a compaction left them, are live again."""
    return _superseded(loc, parts)[0]


def _superseded(loc: layout.Location, parts: list[pafs.FileInfo]) -> tuple[set[str], set[str]]:
    """(paths a compacted part replaces, compacted parts found damaged — now quarantined)."""
    replaced: set[str] = set()
    damaged: set[str] = set()
    for info in parts:
        if layout.is_compacted_name(info.base_name):
            try:
                names: list[str] | None = layout.compacted_from(loc, info.path)
            except FileNotFoundError:
                continue  # another compaction removed it since the listing
            except Exception:  # damage or I/O: judged on the bytes in memory
                try:
                    names = quarantine.compacted_from_checked(loc, info.path)
                except quarantine.PartVanished:
                    continue
                if names is None:
                    damaged.add(info.path)
                    continue
            directory = posixpath.dirname(info.path)
            # Bare part names only: a name with a directory in it ('../../x') would reach outside the dataset.
            replaced.update(posixpath.join(directory, n) for n in names if layout.is_plain_part_name(n))
    return replaced, damaged


def job_has_storage(output_uri: str, job: str, s3_endpoint_url: str | None = None) -> bool:
    """Whether ``job`` has anything under ``output_uri`` — a part or a quarantined part (a wrong OUTPUT_URI has
    neither: nothing there is evidence that a row was lost)."""
    loc = layout.locate(output_uri, s3_endpoint_url)
    return bool(list_parts(loc, job, include_superseded=True) or quarantine.list_quarantined(loc, job))

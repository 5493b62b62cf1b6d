"""Verification after every transfer: each bucket's checksum as the source computed it and as each engine computed
it on what it received, the version each engine reports, and (verify: full) every live engine tensor against the
source's. Any difference raises `WeightSyncError`; nothing here only warns.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from weight_sync.engine_calls import WeightSyncError, weight_checksums, weight_version
from weight_sync.transports import Transfer


def check_bucket_checksums(transfer: Transfer, layouts_names: Sequence[Sequence[str]]) -> None:
    """Every engine reported, for every bucket, the checksum the source computed."""
    problems = []
    for url, sums in transfer.engines.items():
        for index, (want, got) in enumerate(zip(transfer.source, sums)):
            if got is None:
                raise WeightSyncError(f"engine {url} reports no bucket checksums (not an embedded engine?); set "
                                      "sync.verify: full (weights checker) or off for it")
            if want != got:
                names = list(layouts_names[index])
                problems.append(f"{url} bucket {index} ({len(names)} tensors from {names[0]!r}): "
                                f"source {want}, engine {got}")
    if problems:
        raise WeightSyncError("bucket checksum mismatch, the engine's weights are not the trainer's: "
                              + "; ".join(problems[:5]))


def check_versions(urls: Sequence[str], version: str, timeout_s: float, key: str | None = None) -> None:
    """Every engine reports `version` (`key`: the engines' api key, if they have one)."""
    for url in urls:
        reported = weight_version(url, timeout_s, key)
        if reported != version:
            raise WeightSyncError(f"engine {url} reports weight_version {reported!r} after a sync to {version!r}")


def check_full(url: str, source_sums: Mapping[str, str], timeout_s: float, key: str | None = None) -> None:
    """Compare every tensor the engine holds (SGLang's `/weights_checker` checksums, `key`: the key of its admin
    routes) with the source's."""
    engine_sums = weight_checksums(url, timeout_s, key)
    missing = sorted(set(source_sums) - set(engine_sums))
    extra = sorted(set(engine_sums) - set(source_sums))
    differ = sorted(n for n in set(source_sums) & set(engine_sums) if source_sums[n] != engine_sums[n])
    if missing or extra or differ:
        raise WeightSyncError(
            f"engine {url} weights differ from the trainer's: {len(differ)} tensor(s) differ {differ[:5]}, "
            f"{len(missing)} missing on the engine {missing[:5]}, {len(extra)} the trainer does not have {extra[:5]}")

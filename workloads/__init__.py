"""The training workload and its data: what runs on a slice's hosts (no Prefect, no cloud
SDK). Importing the package turns off gcsfs's listing cache, see `_uncached_gcs_listings`."""

from __future__ import annotations

import json
import os
import sys


def _uncached_gcs_listings() -> None:
    """Make every gcsfs filesystem (what `etils.epath` reads gs:// paths with) list afresh.

    gcsfs caches each directory listing for the life of its process, but a run directory
    is written by one process and read by another: the orchestrator listed a run's
    checkpoints before its workload wrote new steps and deleted old ones, and afterwards
    saw neither (a finished rerun failed with "no committed checkpoint"). Set through
    fsspec's config: directly if fsspec is imported already, else in the environment it
    reads when imported (here or in a child process); fsspec itself takes ~90 ms to
    import, which sharding workers need not pay.
    """
    setting = {"use_listings_cache": False}
    config = sys.modules.get("fsspec.config")
    if config is not None:
        config.conf.setdefault("gcs", {}).update(setting)
        return
    try:
        current = json.loads(os.environ.get("FSSPEC_GCS") or "{}")
    except ValueError:
        current = {}  # fsspec warns about it and ignores it itself
    if isinstance(current, dict):
        os.environ["FSSPEC_GCS"] = json.dumps({**current, **setting})


_uncached_gcs_listings()

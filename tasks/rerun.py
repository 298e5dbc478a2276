"""Whether a rerun under an existing run name may resume it: the same training fields and
the same dataset records as the run it resumes (`check_resumable`), else an error saying
what changed and how to resume."""

from __future__ import annotations

import logging
import os
import posixpath

from etils import epath

from tasks.plan import RunPlan
from workloads.config import PipelineConfig, WorkloadConfig, training_fields
from workloads.config_file import ConfigError, load_workload_config
from workloads.data import ShardResult, same_records
from workloads.documents import file_format
from workloads.fingerprint import same_shards, times_only
from workloads.manifest import FORMAT_VERSION, SAME_RECORDS_SINCE, file_sha256, load_manifest
from workloads.rundir import CONFIG
from workloads.sources import DatasetError, SourceFile
from workloads.tokens import load_tokenizer

log = logging.getLogger(__name__)

# Defaults that changed between versions: a run created before, rerun with the same config
# file, differs in the field without its user changing anything. Each says how to resume.
_DEFAULT_CHANGES = {
    ("dataset.errors", "strict", "replace"): (
        " (sources [stdlib] alone read with errors=replace when errors is not set, since "
        "2026-11-25: add --set dataset.errors=strict to resume a run created before)"
    ),
    # Said when auto reads some source file otherwise: reading every file as text, it is
    # no change (`_same_format`).
    ("dataset.format", "text", "auto"): (
        " (format 'auto', reading each file by its name, is the default since 2026-11-23: "
        "add --set dataset.format=text to resume a run created before)"
    ),
}


def check_resumable(
    config: PipelineConfig,
    plan: RunPlan,
    fingerprint: str | None = None,
    files: list[SourceFile] | None = None,
) -> RunPlan:
    """A rerun under an existing name must train the same thing on the same data, or it
    would mix runs.

    Args:
        config: The rerun's config.
        plan: Its plan.
        fingerprint: The dataset its sources give now (`workloads.data.resolve_dataset`),
            or None when they could not all be listed (`tpupipe validate` skips gs://).
            The same sources and options give another dataset once a file is added,
            removed or changed, or the tokenizer file is: resumed checkpoints, and the
            data-iterator state saved in them, would then go on over other records. A
            dataset an older version built from the same sources and options, whose
            records hold the same ids (`workloads.data.same_records`), is no change: the run
            resumes over the new one. Nor are sources whose versions alone changed (a
            `touch`, a copy, a checkout: `workloads.fingerprint.times_only`) when their
            new shards turn out to be the run's own (`same_records_result`).
        files: The source files behind `fingerprint`, to name what changed.

    Returns:
        The plan to run with: for an existing run, with the hash its checkpoints carry (a
        run created by an older version of this code keeps its hash, so an upgrade does
        not turn its checkpoints into another config's), and with `same_records_as` when
        only its sources' versions changed.

    Raises:
        ConfigError: naming every training field that differs from the stored run, or the
            dataset it trained on and what changed since.
    """
    stored = _stored_config(plan)
    if stored is None:
        return plan
    old, new = training_fields(stored.pipeline), training_fields(config)
    listed = fingerprint is not None
    diffs = [
        f"{k}: {old_v!r} -> {new_v!r}{_default_change(k, old_v, new_v)}"
        for k, old_v, new_v in _diff(old, new)
        if not _same_format(k, old_v, new_v, files, listed)
        and not _same_data_elsewhere(k, old_v, new_v, listed, stored.dataset_dir)
    ]
    if diffs:
        raise ConfigError(
            f"run {plan.run_name!r} already exists in {plan.run_dir} with a different "
            f"training config ({'; '.join(diffs)}); resume it with its original config or "
            "choose a new run_name"
        )
    plan = plan.model_copy(update={"config_hash": stored.config_hash})
    trained_on = posixpath.basename(stored.dataset_dir.rstrip("/"))
    if (
        fingerprint is None
        or fingerprint == trained_on
        or same_records(stored.dataset_dir, config.dataset, files or [])
    ):
        return plan
    if times_only(stored.dataset_dir, config.dataset, files or []):
        # Files touched, copied or checked out again: told once the dataset is sharded,
        # before anything is provisioned (`same_records_result`).
        return plan.model_copy(update={"same_records_as": stored.dataset_dir})
    if (ignored := _newly_ignored(plan, stored.dataset_dir, config.dataset.tokenizer)) is not None:
        raise ConfigError(ignored)
    why = _changes(stored.dataset_dir, files or [])
    raise ConfigError(_other_data(plan, stored.dataset_dir, fingerprint, why))


def same_records_result(plan: RunPlan, result: ShardResult, say: bool = True) -> ShardResult:
    """After sharding: what a rerun whose sources changed only their versions trains on.

    The dataset it trained on, if the one just sharded has its shards byte for byte: the
    same records, and the one its checkpoints' data-iterator states name. Any other run
    gets `result` as it is. With `say`, it logs that the run goes on over that dataset.

    Raises:
        ConfigError: the shards differ (a file edited without changing its size), or the
            dataset the run trained on can no longer be read.
    """
    if plan.same_records_as is None:
        return result
    trained = plan.same_records_as
    try:
        before = load_manifest(trained)
    except (DatasetError, OSError) as exc:
        raise ConfigError(_other_data(plan, trained, result.dataset_dir, str(exc))) from None
    if not same_shards(before, result.manifest):
        now = [
            SourceFile(s["uri"], s["key"], s["size"], s["version"])
            for s in result.manifest["sources"]
        ]
        changed = _changes(trained, now)
        name = posixpath.basename(result.dataset_dir.rstrip("/"))
        why = f"{changed}: the shards they give are not the run's"
        raise ConfigError(_other_data(plan, trained, name, why))
    if say:
        log.info(
            "run %s: its sources' modification times changed (or the paths naming them), not "
            "their content (dataset %s has the same shards): it goes on over %s",
            plan.run_name,
            result.dataset_dir,
            trained,
        )
    return ShardResult(trained, before, cached=True)


def _other_data(plan: RunPlan, trained_dir: str, now: str, why: str) -> str:
    trained_on = posixpath.basename(trained_dir.rstrip("/"))
    # Its manifest gone, the sources may be as they were: the dataset is what to restore.
    restore = "that dataset" if why.startswith(_NO_MANIFEST) else "them"
    return (
        f"run {plan.run_name!r} trained on dataset {trained_on} ({trained_dir}), but its "
        f"sources now give dataset {now} ({why}); resuming or evaluating it again would go "
        f"on over other data. Restore {restore}, or choose a new run_name"
    )


_NO_MANIFEST = "its directory holds no readable manifest.json"


def _default_change(key: str, old: object, new: object) -> str:
    """What `_DEFAULT_CHANGES` says of this change, or "". Values may be lists
    (`dataset.sources`), which cannot be looked up: a changed source list raised a
    TypeError where the rerun should have been refused, naming the field."""
    if not isinstance(old, str) or not isinstance(new, str):
        return ""
    return _DEFAULT_CHANGES.get((key, old, new), "")


def _same_data_elsewhere(
    key: str, old: object, new: object, listed: bool, dataset_dir: str
) -> bool:
    """Whether `dataset.sources` or `dataset.tokenizer` changed only in how it names the
    same data, which the dataset check decides, not the spelling: a relative path for the
    absolute one (or `a//b`, a symlink), a copy of the same tokenizer file.

    - sources, once `listed`: the fingerprint covers every file they give (its URI, size
      and version), so the same files give the dataset the run trained on, and others
      are refused naming what was added, removed or changed. Not listed (a sweep's plan,
      gs:// sources in `tpupipe validate`), the names are compared.
    - tokenizer: a file whose sha256 is the one the trained dataset's manifest records
      (the fingerprint covers its content), wherever it is: the path stored may be
      relative to another directory, or gone. A file that cannot be read is a change
      (its error comes with the inputs).
    """
    if key == "dataset.sources":
        return listed
    if key != "dataset.tokenizer" or not old or not new:
        return False
    try:
        trained = load_manifest(dataset_dir)["tokenizer"].get("sha256")
    except (DatasetError, OSError, KeyError, TypeError, AttributeError):
        trained = None  # its dataset gone: the dataset check says so
    try:
        return file_sha256(str(new)) == trained
    except OSError:
        return False


def _newly_ignored(plan: RunPlan, dataset_dir: str, tokenizer: str | None) -> str | None:
    """The refusal of a run whose dataset was built, by a version before they were turned
    off, with its tokenizer file's truncation or padding (`TokenizerSpec.ignores`): the
    same file now gives whole documents, other records. The general refusal said the
    tokenizer file or an option changed and to restore them, where nothing had."""
    try:
        built = load_manifest(dataset_dir)["tokenizer"]
        now = load_tokenizer(tokenizer)
    except (DatasetError, OSError, KeyError, TypeError):
        return None
    if not now.ignores or built.get("ignores") or built.get("sha256") != now.sha256:
        return None
    return (
        f"run {plan.run_name!r} trained on dataset {dataset_dir}, built from tokenizer file "
        f"{now.path} with its {' and '.join(now.ignores)}, which this version turns off "
        "(documents are encoded whole): the same file now gives other records, and resuming "
        "would go on over them. Choose a new run_name"
    )


def _same_format(
    key: str, old: object, new: object, files: list[SourceFile] | None, listed: bool
) -> bool:
    """Whether `dataset.format` changed only between a format and "auto" (the default
    since 2026-11-23), either way, where auto reads every source file in that format: the
    same dataset (its fingerprint records the format the files resolve to). So a run
    created before resumes with its config file as it was, and with its explicit format
    again after a rerun with the default wrote "auto" into its config.json.

    With the sources not all `listed` (a sweep's plan, gs:// sources in `tpupipe
    validate`) it cannot be told here: the run decides once it lists them, before it
    provisions anything.
    """
    if key != "dataset.format" or "auto" not in (old, new):
        return False
    if not listed:
        return True
    fixed = new if old == "auto" else old
    return bool(files) and all(file_format(f.uri, "auto") == fixed for f in files)


def _changes(dataset_dir: str, files: list[SourceFile], most: int = 3) -> str:
    """The source files added, removed or changed since `dataset_dir` was sharded, from its
    manifest (where the run's datasets are: local, or published to gs://); else that it was
    built in an older dataset format, that its manifest is gone, or the general causes."""
    try:
        manifest = load_manifest(dataset_dir)
    except (DatasetError, OSError):
        how = "deleted from the bucket?" if "://" in dataset_dir else "deleted with the datasets?"
        return (
            f"{_NO_MANIFEST} ({how}), so whether the sources still give its records cannot be told"
        )
    try:
        before = {s["uri"]: (s["size"], s["version"]) for s in manifest["sources"]}
    except (KeyError, TypeError):
        before = None
    if before is None or not files:
        return "a source file was added, removed or changed, or the tokenizer file was"
    now = {f.uri: (f.size, f.version) for f in files}
    kept = [u for u in now if u in before and now[u] != before[u]]
    found = [
        ("added", [u for u in now if u not in before]),
        ("removed", [u for u in before if u not in now]),
        ("changed", [u for u in kept if now[u][0] != before[u][0]]),
        # Told apart: such a file may hold the bytes it held (touched, copied, restored).
        ("modified, same size", [u for u in kept if now[u][0] == before[u][0]]),
    ]
    reordered = before.keys() == now.keys() and list(before) != list(now)
    if any(uris for _, uris in found[:3]) or reordered:
        # Refused for those: these were not compared.
        found[3] = ("rewritten, same size (perhaps the same bytes)", found[3][1])
    said = [
        f"{how}: {', '.join(uris[:most])}{' …' * (len(uris) > most)}" for how, uris in found if uris
    ]
    if reordered:  # said first, also beside files uploaded again (probe S: only those were)
        order = (
            "the same source files in another order (the order of dataset.sources, and of "
            "the files each gives, is the order of the records); list them as before"
        )
        return "; ".join([order, *said])
    version = manifest.get("format_version")
    if not said and isinstance(version, int) and version < SAME_RECORDS_SINCE:
        return (
            f"the same source files, but an older tpupipe built it in dataset format "
            f"{version}, whose records this version's format {FORMAT_VERSION} does not "
            "reproduce"
        )
    return "; ".join(said) or "the tokenizer file or a dataset option changed"


def _stored_config(plan: RunPlan) -> WorkloadConfig | None:
    """The config.json an earlier invocation of the run wrote, or None for a new run.

    Raises:
        ConfigError: naming the file when it does not read as a workload config (torn,
            not UTF-8, edited): a rerun cannot be checked against it, and treating it as
            absent would let one train something else over the run's checkpoints.
    """
    path = epath.Path(plan.run_dir) / CONFIG
    if not path.exists():
        return None
    try:
        return load_workload_config(os.fspath(path))
    except ConfigError as exc:
        raise ConfigError(
            f"{exc}; it records what run {plan.run_name!r} trained, which a rerun must "
            "match: restore it, or choose a new run_name"
        ) from None


def _diff(old: dict, new: dict, prefix: str = ""):
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            yield from _diff(a, b, f"{prefix}{key}.")
        elif a != b:
            yield f"{prefix}{key}", a, b

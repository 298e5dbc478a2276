"""The local slice provider runs real process groups: these tests start and kill them."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from infra.slices import (
    LocalSliceProvider,
    ProvisioningError,
    SliceError,
    SliceProvider,
    SliceSpec,
    SliceState,
    build_provider,
)
from tests.helpers import REPO, processes_mentioning


def _wait_for(predicate, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not (result := predicate()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
    return result


def _group_gone(pgid: int) -> bool:
    """No process of the group is alive. Zombies are dead: where PID 1 never reaps orphans
    (some containers), a killed grandchild stays one and `killpg(pgid, 0)` still succeeds."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if fields[2] == str(pgid) and fields[0] not in "ZX":
            return False
    return True


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def _spec(tmp_path: Path, name: str, code: str, **kw) -> SliceSpec:
    kw.setdefault("devices", 2)
    return SliceSpec(name=name, command=_py(code), log_path=str(tmp_path / f"{name}.log"), **kw)


SLEEPER = "import time; time.sleep(60)"


@pytest.fixture
def provider(tmp_path):
    p = LocalSliceProvider(tmp_path / "registry")
    yield p
    for s in p.list():
        p.delete(s.name, grace_s=0)


def test_create_runs_workload_as_own_group_and_delete_kills_everything(provider, tmp_path):
    out = tmp_path / "env.json"
    code = f"""
        import json, os, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        print("to stdout", flush=True); print("to stderr", file=sys.stderr, flush=True)
        info = dict(xla=os.environ["XLA_FLAGS"], platforms=os.environ["JAX_PLATFORMS"],
                    extra=os.environ["EXTRA"], pid=os.getpid(), pgid=os.getpgid(0),
                    grandchild=child.pid)
        open({str(out)!r} + ".tmp", "w").write(json.dumps(info))
        os.replace({str(out)!r} + ".tmp", {str(out)!r})
        time.sleep(60)
    """
    env = {"EXTRA": "1", "XLA_FLAGS": "--xla_dump_to=/x --xla_force_host_platform_device_count=1"}
    status = provider.create(_spec(tmp_path, "s1", code, devices=4, env=env, labels={"a": "b"}))
    assert status.state is SliceState.READY and status.labels == {"a": "b"}
    info = json.loads(_wait_for(lambda: out.exists() and out.read_text()))
    assert info["xla"] == "--xla_dump_to=/x --xla_force_host_platform_device_count=4"
    assert info["platforms"] == "cpu" and info["extra"] == "1"
    assert info["pgid"] == info["pid"] != os.getpgid(0)  # its own process group
    record = json.loads((tmp_path / "registry" / "s1.json").read_text())
    assert (record["pid"], record["pgid"], record["devices"]) == (info["pid"], info["pid"], 4)
    assert provider.status("s1").state is SliceState.READY
    log = _wait_for(lambda: "to stderr" in (t := Path(record["log_path"]).read_text()) and t)
    assert "to stdout" in log

    assert provider.delete("s1") is True
    with pytest.raises(ProcessLookupError):
        os.kill(info["pid"], 0)  # the leader is dead and reaped
    assert _group_gone(info["pgid"])  # the grandchild too
    assert provider.delete("s1") is False
    assert provider.status("s1").state is SliceState.NOT_FOUND
    assert not (tmp_path / "registry" / "s1.json").exists()


def test_exit_code_and_recreate_after_exit(provider, tmp_path):
    provider.create(_spec(tmp_path, "s2", "raise SystemExit(3)"))
    status = _wait_for(lambda: (s := provider.status("s2")).state is SliceState.TERMINATED and s)
    assert status.exit_code == 3
    # An exited slice does not block its name; a running one does.
    provider.create(_spec(tmp_path, "s2", SLEEPER))
    with pytest.raises(SliceError, match="s2"):
        provider.create(_spec(tmp_path, "s2", SLEEPER))
    assert provider.delete("s2", grace_s=0.5) is True
    assert provider.delete("s2") is False


def test_sigterm_ignored_is_killed(provider, tmp_path):
    ready = tmp_path / "ready"
    code = f"""
        import pathlib, signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        pathlib.Path({str(ready)!r}).touch()
        time.sleep(60)
    """
    provider.create(_spec(tmp_path, "stubborn", code))
    _wait_for(ready.exists)
    pgid = json.loads((tmp_path / "registry/stubborn.json").read_text())["pgid"]
    start = time.monotonic()
    assert provider.delete("stubborn", grace_s=0.2) is True
    # It outlived the grace period (SIGTERM ignored), then SIGKILL ended it promptly.
    assert 0.2 <= time.monotonic() - start < 5
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)


def test_second_instance_lists_and_deletes(provider, tmp_path):
    labels = {"managed-by": "tpupipe", "flow-run": "abc"}
    provider.create(_spec(tmp_path, "shared", SLEEPER, labels=labels))
    other = LocalSliceProvider(tmp_path / "registry")
    (seen,) = other.list({"flow-run": "abc"})
    assert (seen.name, seen.state, seen.exit_code, seen.labels) == (
        "shared",
        SliceState.READY,
        None,
        labels,
    )
    pgid = json.loads((tmp_path / "registry/shared.json").read_text())["pgid"]
    assert other.delete("shared", grace_s=1) is True
    assert provider.status("shared").state is SliceState.NOT_FOUND  # and reaps its child
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)
    assert other.delete("shared") is False and provider.delete("shared") is False


def test_slice_created_by_another_process(provider, tmp_path):
    registry = tmp_path / "registry"
    script = f"""
        import sys
        from infra.slices import LocalSliceProvider, SliceSpec
        p = LocalSliceProvider({str(registry)!r})
        for name, code in (("live", "import time; time.sleep(60)"), ("done", "pass")):
            p.create(SliceSpec(name=name, devices=1, labels={{"k": "v"}},
                               command=[sys.executable, "-c", code],
                               log_path={str(tmp_path)!r} + "/" + name + ".log"))
    """
    subprocess.run(_py(script), check=True, cwd=Path(__file__).parents[1], timeout=30)
    assert provider.status("live").state is SliceState.READY
    done = _wait_for(lambda: (s := provider.status("done")).state is SliceState.TERMINATED and s)
    assert done.exit_code is None  # not ours: the exit code is unknowable
    assert {s.name for s in provider.list({"k": "v"})} == {"live", "done"}
    pgid = json.loads((registry / "live.json").read_text())["pgid"]
    assert provider.delete("live", grace_s=1) is True
    assert _group_gone(pgid)
    assert provider.delete("done") is True and provider.list() == []


def test_list_filters_by_labels(provider, tmp_path):
    provider.create(_spec(tmp_path, "a", SLEEPER, labels={"team": "a", "env": "x"}))
    provider.create(_spec(tmp_path, "b", SLEEPER, labels={"team": "b", "env": "x"}))
    assert [s.name for s in provider.list({"team": "a"})] == ["a"]
    assert [s.name for s in provider.list({"env": "x"})] == ["a", "b"]
    assert [s.name for s in provider.list()] == ["a", "b"]
    assert provider.list({"team": "a", "env": "y"}) == []


def test_a_record_that_cannot_be_read_is_skipped_with_a_warning(provider, tmp_path, caplog):
    # Another user's record, mode 600 in a shared root (here a directory: unreadable to
    # root too), had made list() raise: the reaper judged no slice at all, and every run's
    # teardown hook failed with a traceback (/tmp/s34/probeB/repros/r4_*.sh).
    provider.create(_spec(tmp_path, "a", SLEEPER, labels={"team": "a"}))
    (tmp_path / "registry" / "theirs.json").mkdir()
    assert [s.name for s in provider.list({"team": "a"})] == ["a"]
    assert f"slice record {tmp_path / 'registry' / 'theirs.json'} cannot be read" in caplog.text
    assert provider.delete("a", grace_s=0)


def test_a_group_of_another_user_is_named_when_it_cannot_be_signalled(monkeypatch):
    # A teammate's orphaned slice: the reaper and a rerun failed with a bare
    # "[Errno 1] Operation not permitted" (/tmp/s34/probeD/repros/s3b_*.sh).
    import pwd
    import signal

    from infra.slices.procs import signal_group

    def refused(pgid, sig):
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "killpg", refused)
    me = pwd.getpwuid(os.getuid()).pw_name
    with pytest.raises(PermissionError) as err:
        signal_group(os.getpgid(0), signal.SIGTERM)
    assert f"cannot signal process group {os.getpgid(0)}, {me}'s: only {me} or root" in str(
        err.value
    )
    monkeypatch.undo()
    signal_group(2**22 + 7, signal.SIGTERM)  # a group that is gone: nothing to do


def test_spec_and_factory_validation(tmp_path):
    with pytest.raises(ValueError, match="name"):
        _spec(tmp_path, "Bad_Name", SLEEPER)
    with pytest.raises(ValueError, match="argv"):
        SliceSpec(name="x", devices=1, command="python -c pass", log_path="l")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="label"):
        _spec(tmp_path, "x", SLEEPER, labels={"Owner": "me"})
    p = build_provider("local", str(tmp_path))
    assert isinstance(p, SliceProvider)
    assert build_provider("local", str(tmp_path / "." / "")) is p
    assert (tmp_path / "slices").is_dir()
    with pytest.raises(SliceError, match="devices=3 cannot be split evenly over hosts=2"):
        p.create(_spec(tmp_path, "multi", SLEEPER, hosts=2, devices=3))
    with pytest.raises(ValueError, match="gcp"):
        build_provider("gcp", str(tmp_path))


def test_a_program_that_cannot_start_fails_for_good_and_a_lack_of_processes_is_retried(
    provider, tmp_path, monkeypatch
):
    """Only a create that may succeed next time is a ProvisioningError (retried with
    backoff, resilience.max_failures times); a missing program fails the run at once."""
    spec = SliceSpec(
        name="gone",
        devices=1,
        command=[str(tmp_path / "no-such-python")],
        log_path=str(tmp_path / "l"),
    )
    with pytest.raises(SliceError, match=r"cannot start .*no-such-python") as caught:
        provider.create(spec)
    assert not isinstance(caught.value, ProvisioningError)
    assert provider.status("gone").state is SliceState.NOT_FOUND

    def no_process(*args, **kwargs):
        raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    with pytest.raises(ProvisioningError, match="Resource temporarily unavailable"):
        provider.create(_spec(tmp_path, "busy", SLEEPER))
    assert provider.status("busy").state is SliceState.NOT_FOUND


def test_delete_where_takes_only_a_slice_whose_labels_pass(provider, tmp_path):
    """The run-root of two runs of one name told apart: a delete restricted to the other
    root's labels leaves the slice running; one matching them deletes it."""
    provider.create(_spec(tmp_path, "named", SLEEPER, labels={"run-root": "aaaa"}))
    assert [s.labels for s in provider.copies("named")] == [{"run-root": "aaaa"}]
    assert (
        provider.delete("named", grace_s=0, where=lambda lb: lb.get("run-root") == "bbbb") is False
    )
    assert provider.status("named").state is SliceState.READY
    assert (
        provider.delete("named", grace_s=0, where=lambda lb: lb.get("run-root") == "aaaa") is True
    )
    assert provider.status("named").state is SliceState.NOT_FOUND
    assert provider.copies("named") == []


def test_delete_unknown_is_false(provider):
    assert provider.delete("never-existed") is False
    assert provider.status("never-existed").state is SliceState.NOT_FOUND


HOST = """
import json, os, sys, time
out = {k: os.environ.get(k) for k in
       ("XLA_FLAGS", "TPUPIPE_PROCESS_ID", "TPUPIPE_NUM_PROCESSES", "TPUPIPE_COORDINATOR_ADDRESS")}
out["pgid"] = os.getpgid(0)
with open(os.path.join(sys.argv[1], "host" + out["TPUPIPE_PROCESS_ID"] + ".json"), "w") as f:
    json.dump(out, f)
if out["TPUPIPE_PROCESS_ID"] == sys.argv[2]:
    sys.exit(int(sys.argv[3]))
time.sleep(60)
"""


def _hosts_spec(tmp_path: Path, name: str, failing_host: int, code: int) -> SliceSpec:
    command = [sys.executable, "-c", HOST, str(tmp_path), str(failing_host), str(code)]
    return SliceSpec(
        name=name, devices=8, hosts=2, command=command, log_path=str(tmp_path / f"{name}.log")
    )


def test_multi_host_slice_is_one_group_with_a_coordinator(provider, tmp_path):
    provider.create(_hosts_spec(tmp_path, "two-hosts", failing_host=-1, code=0))
    hosts = [
        json.loads(
            _wait_for(
                lambda i=i: (
                    (tmp_path / f"host{i}.json").exists()
                    and (tmp_path / f"host{i}.json").read_text()
                )
            )
        )
        for i in range(2)
    ]
    assert [h["TPUPIPE_PROCESS_ID"] for h in hosts] == ["0", "1"]
    assert {h["TPUPIPE_NUM_PROCESSES"] for h in hosts} == {"2"}
    assert hosts[0]["TPUPIPE_COORDINATOR_ADDRESS"] == hosts[1]["TPUPIPE_COORDINATOR_ADDRESS"]
    assert all("device_count=4" in h["XLA_FLAGS"] for h in hosts)  # 8 devices over 2 hosts
    assert hosts[0]["pgid"] == hosts[1]["pgid"]
    assert (tmp_path / "two-hosts-host1.log").exists()
    assert provider.status("two-hosts").state is SliceState.READY
    assert provider.delete("two-hosts", grace_s=0.5) is True
    assert _group_gone(hosts[0]["pgid"])


def test_a_crashed_host_ends_the_slice_at_once(provider, tmp_path):
    """Host 1 crashes while host 0 would wait for it forever: the slice reports the crash."""
    provider.create(_hosts_spec(tmp_path, "one-crashes", failing_host=1, code=3))
    status = _wait_for(
        lambda: (s := provider.status("one-crashes")).state is SliceState.TERMINATED and s
    )
    assert status.exit_code == 3
    provider.delete("one-crashes", grace_s=0.5)


class _Exited:
    def __init__(self, code: int | None) -> None:
        self.pid, self.returncode = 1, code


@pytest.mark.parametrize(
    ("codes", "reported"),
    [
        ([1, -9], -9),  # host 1 lost, host 0 failed in its broken collective
        ([-6, -9], -9),  # ... or JAX aborted host 0
        ([-6, 1], -6),  # a crash outranks the other host's error
        ([None, -9], -9),  # reported at once, while host 0 still blocks
        ([75, 0], 75),
        ([0, None], None),
        ([1, 75], 75),  # host 1 stopped for a notice host 0 never saw; host 0 timed out
        ([-6, 75], 75),  # ... or JAX aborted host 0
        ([-9, 75], -9),  # a lost host is retried as a preemption all the same
    ],
)
def test_a_lost_host_is_reported_before_the_hosts_that_failed_because_of_it(codes, reported):
    """The first failed code in host order was reported: with host 1 killed and host 0
    exiting 1 from its broken collectives in the same poll, a lost host (a preemption,
    retried) looked like a workload bug (the run failed at once)."""
    from infra.slices.procs import HostGroup

    assert HostGroup([_Exited(c) for c in codes]).returncode == reported


@pytest.mark.parametrize(
    ("codes", "host"),
    [([1, -9], 1), ([-6, 1], 0), ([0, -11], 1), ([0, 0], None), ([0, None], None), ([-11], None)],
)
def test_the_host_whose_exit_ended_the_slice_is_known(codes, host):
    from infra.slices.procs import HostGroup

    assert HostGroup([_Exited(c) for c in codes]).cause_host() == host


def test_a_creator_killed_before_it_records_its_slice_leaves_no_workload_running(tmp_path):
    # SIGKILLed between the fork and the record (signals_held cannot hold SIGKILL back),
    # the orchestrator left a workload training that no record named: no reaper, teardown
    # or rerun could find it (probe Q, session 39). Its hosts now wait behind a gate.
    marker = tmp_path / "ran"
    workload = (
        f"import pathlib, time; pathlib.Path({str(marker)!r}).write_text('ran'); time.sleep(60)"
    )
    creator = textwrap.dedent(
        f"""
        import os, signal, sys
        from infra.slices import LocalSliceProvider, SliceSpec
        provider = LocalSliceProvider({str(tmp_path / "registry")!r})
        provider._write_record = lambda record: os.kill(os.getpid(), signal.SIGKILL)
        provider.create(SliceSpec(name="cut", devices=2, hosts=2, log_path={str(tmp_path / "l")!r},
                                  command=[sys.executable, "-c", {workload!r}]))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", creator], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )  # fmt: skip
    assert done.returncode == -9
    time.sleep(3)  # time enough for a host to have started its command
    assert not marker.exists()
    assert processes_mentioning(str(marker)) == []


def test_a_slice_recorded_in_another_pid_namespace_is_neither_judged_nor_signalled(tmp_path):
    # A reaper in a container sharing the root saw a live slice's pids as gone: it dropped
    # the record (the workload trained on, unrecorded) and signalled whatever held that
    # pgid in its own namespace (probe Q, session 39). Here this process stands in for a
    # process there: it must survive, and the slice must stay.
    from infra.slices.procs import process_space

    registry = tmp_path / "registry"
    registry.mkdir()
    boot, ns = process_space().split("/")
    record = {
        "name": "theirs", "pid": os.getpid(), "pids": [os.getpid()], "pgid": os.getpgid(0),
        "start_ticks": "1", "labels": {}, "devices": 1, "hosts": 1, "command": ["x"],
        "created_at": "2026-11-28T00:00:00+00:00", "owner_pid": os.getpid(),
        "owner_start_ticks": "1", "log_path": str(tmp_path / "l"),
        "space": f"{boot}/pid:[1]",  # this boot, another PID namespace
    }  # fmt: skip
    (registry / "theirs.json").write_text(json.dumps(record))
    provider = LocalSliceProvider(registry)
    assert provider.status("theirs").state is SliceState.READY  # not seen: never "over"
    assert provider.owner_gone("theirs") is False
    with pytest.raises(SliceError, match="another PID namespace"):
        provider.delete("theirs", grace_s=0)
    assert (registry / "theirs.json").exists()
    # Written before this boot: nothing of it runs, and its pgid is someone else's now.
    record["space"] = f"another-boot/{ns}"
    (registry / "theirs.json").write_text(json.dumps(record))
    assert provider.status("theirs").state is SliceState.TERMINATED
    assert provider.owner_gone("theirs") is True
    assert provider.delete("theirs", grace_s=0) is True  # the record only: no signal sent
    assert not (registry / "theirs.json").exists()


def test_a_program_that_is_not_executable_is_refused_as_exec_refuses_it(provider, tmp_path):
    # Behind the gate, it was said to be missing: 'No such file or directory' for a file
    # that is there (probe G, session 39).
    script = tmp_path / "train.sh"
    script.write_text("echo hi\n")  # mode 644
    spec = SliceSpec(name="noexec", devices=1, command=[str(script)], log_path=str(tmp_path / "l"))
    with pytest.raises(SliceError, match=r"\[Errno 13\] Permission denied: .*train\.sh"):
        provider.create(spec)


def test_a_host_dead_before_its_gate_opens_is_an_ended_host_not_a_failed_create():
    # Killed between its record and the gate's opening (an OOM kill), its closed pipe
    # made the create raise a bare BrokenPipeError and left a record behind (probe G).
    from infra.slices.gate import Gate

    gate = Gate()
    _, dead = gate.gated(["true"])
    _, alive = gate.gated(["true"])
    os.close(dead)  # the dead host's end
    gate.open()
    assert os.read(alive, 10) == b"g\n"
    os.close(alive)

"""The supervisor against the real nvidia-cuda-mps-control: start, crash, hang, crash loop,
reload, FAULT reporting, compute mode. Faults are real signals. Timings are generous (the
machine is small and shared); numbers belong in benchmarks/recovery.py."""

from __future__ import annotations

import os
import signal
import time

import pytest

from mpsd.daemon.control import Control, parse_server_status
from mpsd.errors import ConfigError, ControlTimeout
from tests.mpsbin import knows_server_status
from tests.mpsfixtures import FrontEndHolder

pytestmark = pytest.mark.mps_binary
G, M = 1 << 30, 1 << 20


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie still answers kill(0): look at its state
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] == "Z"


def wait_until(predicate, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def reads_back(config, atp, limits, priority=None):
    c = Control(config.control_binary, config.pipe_dir, timeout=10)
    assert c.get_default_active_thread_percentage() == atp
    for device, nbytes in limits.items():
        assert c.get_default_device_pinned_mem_limit(device) == nbytes
    if priority is not None:
        assert c.get_default_client_priority() == priority


@pytest.mark.every_mps_version
def test_start_applies_defaults_before_ready(make_config, run_supervisor):
    config = make_config(
        **{"active-thread-percentage": "40", "pinned-mem-limit": "0=2G,1=1044M", "client-priority": "1"}
    )
    r = run_supervisor(config)
    state = r.wait_for(lambda s: s.configured, what="configured")
    assert state.daemon_up and state.last_error == ""
    reads_back(config, 40.0, {0: 2 * G, 1: 1 * G}, priority=1)  # 1044M reads back as 1G
    log = open(os.path.join(config.log_dir, "control.log")).read()
    assert "Cmd:set_default_active_thread_percentage 40" in log
    assert "Cmd:set_default_device_pinned_mem_limit 1 1044M" in log
    r.wait_for(lambda s: r.sup.status().health_latency is not None, what="a health check")


@pytest.mark.every_mps_version
def test_sigkill_restarts_and_reapplies_defaults(make_config, run_supervisor):
    config = make_config(**{"active-thread-percentage": "30", "pinned-mem-limit": "0=512M"})
    r = run_supervisor(config)
    r.wait_for(lambda s: s.configured)
    first = r.sup.status().pid
    os.kill(first, signal.SIGKILL)
    r.wait_for(lambda s: r.sup.status().pid not in (None, first) and s.configured, what="restart")
    status = r.sup.status()
    assert status.restarts == 1
    wait_until(lambda: gone(first), what="old daemon reaped")
    reads_back(config, 30.0, {0: 512 * M})


@pytest.mark.every_mps_version
def test_sigstop_is_detected_as_hung_killed_and_restarted(make_config, run_supervisor):
    config = make_config(**{"health-timeout": "1s", "active-thread-percentage": "55"})
    r = run_supervisor(config)
    r.wait_for(lambda s: s.configured)
    hung = r.sup.status().pid
    os.kill(hung, signal.SIGSTOP)
    state = r.wait_for(lambda s: not s.configured, what="hang noticed")
    assert "hung" in state.last_error
    r.wait_for(lambda s: r.sup.status().pid not in (None, hung) and s.configured, timeout=60, what="restart after hang")
    wait_until(lambda: gone(hung), what="hung daemon killed")
    reads_back(config, 55.0, {})


class SlowAnswers:
    """The real front-end, except that the health check's first command times out on the
    checks whose number (from 1) is in ``silent``: a loaded node, not a hung daemon."""

    def __init__(self, real: Control, silent: set[int], counter: list[int]) -> None:
        self.real, self.silent, self.counter = real, silent, counter

    def __getattr__(self, name):
        return getattr(self.real, name)

    def batch(self, commands, timeout=None):
        if commands[0] == "get_default_active_thread_percentage":  # the health check reads the defaults first
            self.counter[0] += 1
            if self.counter[0] in self.silent:
                raise ControlTimeout(
                    "'get_default_active_thread_percentage': no answer from the MPS control daemon in 2s"
                )
        return self.real.batch(commands, timeout)


@pytest.mark.parametrize("silent", [{1}, {1, 3, 5}])
def test_one_unanswered_health_check_at_a_time_keeps_the_daemon(make_config, run_supervisor, monkeypatch, silent):
    r = run_supervisor(make_config())
    r.wait_for(lambda s: s.configured)
    pid, real, counter = r.sup.status().pid, r.sup.control, [0]
    monkeypatch.setattr(r.sup, "control", lambda timeout=None: SlowAnswers(real(timeout), silent, counter))
    wait_until(lambda: counter[0] >= max(silent) + 2, what="health checks past the silent ones")
    assert r.sup.status().pid == pid and r.sup.status().restarts == 0 and r.board.current().configured


def test_two_unanswered_health_checks_in_a_row_kill_the_daemon(make_config, run_supervisor, monkeypatch):
    r = run_supervisor(make_config())
    r.wait_for(lambda s: s.configured)
    pid, real, counter = r.sup.status().pid, r.sup.control, [0]
    monkeypatch.setattr(r.sup, "control", lambda timeout=None: SlowAnswers(real(timeout), {2, 3}, counter))
    state = r.wait_for(lambda s: not s.configured, what="hang noticed")
    assert "hung" in state.last_error and "2 health checks in a row" in state.last_error
    r.wait_for(lambda s: r.sup.status().pid not in (None, pid) and s.configured, timeout=60, what="restart")
    wait_until(lambda: counter[0] >= 4, what="the new daemon checked")


def test_crash_loop_backs_off(make_config, run_supervisor, tmp_path):
    starts = tmp_path / "starts"
    binary = tmp_path / "crashing-control"
    binary.write_text(f'#!/bin/sh\n[ "$1" = "-f" ] && date +%s.%N >> {starts}\nexit 1\n')
    binary.chmod(0o755)
    config = make_config(  # multiUser off: no -f -multiuser-server probe among the starts counted
        **{"control-binary": str(binary), "restart-backoff-initial": "0.1s", "restart-backoff-max": "0.8s",
           "multi-user": "off"}
    )
    r = run_supervisor(config)
    state = r.wait_for(lambda s: "crash loop" in s.last_error, what="crash loop reported")
    assert not state.daemon_up and not state.configured
    time.sleep(3)
    times = [float(t) for t in starts.read_text().split()]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    # Expected waits 0.1, 0.2, 0.4, 0.8, 0.8 ...: a hammering loop would start hundreds of times.
    assert len(times) <= 12, times
    assert gaps[0] >= 0.08
    assert all(g >= 0.7 for g in gaps[3:]), gaps
    assert r.sup.status().failures_in_row >= 4


def test_reload_applies_new_defaults_live_and_defers_the_rest(make_config, run_supervisor, caplog):
    config = make_config(**{"active-thread-percentage": "80"})
    new = {
        "config": make_config(
            **{"active-thread-percentage": "20", "pinned-mem-limit": "0=3G", "pipe-dir": "/tmp/elsewhere"}
        )
    }

    def reload():
        value = new["config"]
        if isinstance(value, Exception):
            raise value
        return value

    r = run_supervisor(config, reload=reload)
    r.wait_for(lambda s: s.configured)
    pid = r.sup.status().pid
    r.sup.reload()
    wait_until(lambda: r.sup.status().config_generation == 2, what="reload")
    reads_back(config, 20.0, {0: 3 * G})
    assert r.sup.status().pid == pid  # no restart needed
    assert r.sup.config.pipe_dir == config.pipe_dir  # pipeDir applies only after a restart of mpsd
    assert "key=pipeDir changed: applies only after mpsd restarts" in caplog.text
    new["config"] = ConfigError("config.yaml: healthInterval: expected a duration")
    r.sup.reload()
    state = r.wait_for(lambda s: "reload failed" in s.last_error, what="reload failure")
    assert state.configured and r.sup.status().config_generation == 2
    reads_back(config, 20.0, {0: 3 * G})


@pytest.mark.every_mps_version
def test_reload_removes_defaults_the_new_config_drops(make_config, run_supervisor):
    # A long health timeout: a restart (under load) would clear the defaults by itself.
    slow = {"health-timeout": "30s"}
    config = make_config(**{"pinned-mem-limit": "0=2G,1=1G", "client-priority": "1"}, **slow)
    new = make_config(**{"pinned-mem-limit": "0=3G"}, **slow)
    r = run_supervisor(config, reload=lambda: new)
    r.wait_for(lambda s: s.configured)
    pid = r.sup.status().pid
    reads_back(config, 100.0, {0: 2 * G, 1: 1 * G}, priority=1)
    r.sup.reload()
    wait_until(lambda: r.sup.status().config_generation == 2, what="reload")
    reads_back(config, 100.0, {0: 3 * G, 1: None}, priority=0)  # as a restarted daemon would have them
    assert r.board.current().configured and r.sup.status().pid == pid


@pytest.mark.every_mps_version
def test_a_front_end_held_open_is_not_a_dead_daemon(make_config, run_supervisor, mps_control):
    # The daemon serves one front-end at a time; an operator's interactive session must not
    # get it (and every client) killed.
    # healthTimeout 3 s (the default): with 1 s, a front-end that took over a second to run on a
    # loaded 2-core machine was a hung daemon, and the test saw a restart
    config = make_config(**{"health-timeout": "3s", "active-thread-percentage": "60"})
    r = run_supervisor(config)
    r.wait_for(lambda s: s.configured)
    pid = r.sup.status().pid
    holder = FrontEndHolder(str(mps_control), config.pipe_dir)
    try:
        wait_until(lambda: "another front-end holds" in r.sup.status().last_error, what="busy noticed")
        time.sleep(3.5)  # at least one more health check while it is held
        assert r.sup.status().pid == pid and r.sup.status().restarts == 0 and r.board.current().configured
    finally:
        holder.release()
    wait_until(lambda: r.sup.status().last_error == "", what="a passing health check")
    assert r.sup.status().pid == pid
    reads_back(config, 60.0, {})


def test_reload_while_the_daemon_is_held_applies_at_a_later_health_check(make_config, run_supervisor, mps_control):
    config = make_config(**{"health-timeout": "3s", "active-thread-percentage": "60"})
    new = make_config(**{"health-timeout": "3s", "active-thread-percentage": "20"})
    r = run_supervisor(config, reload=lambda: new)
    r.wait_for(lambda s: s.configured)
    pid = r.sup.status().pid
    holder = FrontEndHolder(str(mps_control), config.pipe_dir)
    try:
        r.sup.reload()
        wait_until(lambda: "new defaults not applied yet" in r.sup.status().last_error, what="reload deferred")
    finally:
        holder.release()
    wait_until(lambda: r.sup.status().last_error == "", what="defaults applied")
    reads_back(config, 20.0, {})
    assert r.sup.status().pid == pid


class FaultyServers:
    """The real front-end, plus one MPS server in the given state (no GPU makes real ones)."""

    def __init__(self, real: Control, state: str | None) -> None:
        self.real, self.state = real, state

    def __getattr__(self, name):
        return getattr(self.real, name)

    def get_server_list(self):
        self.real.get_server_list()
        return [4242]

    def get_server_status(self, pid):
        if self.state is None:
            return self.real.get_server_status(pid)  # 535: Unknown command
        return parse_server_status(self.state)


def test_server_in_fault_marks_managed_gpus_unhealthy(make_config, run_supervisor, monkeypatch):
    r = run_supervisor(make_config(), gpu_indices=lambda: [0, 1])
    r.wait_for(lambda s: s.configured)
    real = r.sup.control
    monkeypatch.setattr(r.sup, "control", lambda timeout=None: FaultyServers(real(timeout), "FAULT"))
    state = r.wait_for(lambda s: s.faulted_gpus, what="FAULT published")
    assert state.faulted_gpus == {0, 1} and not state.gpu_healthy(0)
    assert "4242" in state.last_error and "FAULT" in state.last_error
    monkeypatch.setattr(r.sup, "control", lambda timeout=None: FaultyServers(real(timeout), "ACTIVE"))
    state = r.wait_for(lambda s: not s.faulted_gpus, what="FAULT cleared")
    assert state.gpu_healthy(0) and state.last_error == ""


@pytest.mark.every_mps_version
def test_get_server_status_unknown_or_its_server_gone_is_not_a_failure(
    make_config, run_supervisor, monkeypatch, mps_version
):
    # 535 does not know the command (FAULT detection off, said once); 550+ knows it and answers
    # "Server 4242 not found" for a server listed a moment before (it exited meanwhile).
    r = run_supervisor(make_config(), gpu_indices=lambda: [0])
    r.wait_for(lambda s: s.configured)
    real = r.sup.control
    pid = r.sup.status().pid
    monkeypatch.setattr(r.sup, "control", lambda timeout=None: FaultyServers(real(timeout), None))
    checks = r.sup.status().health_checks
    wait_until(lambda: r.sup.status().servers == (4242,) and r.sup.status().health_checks > checks + 1,
               what="health checks with a server")
    assert r.sup._faults.supports_status is (None if knows_server_status(mps_version) else False)
    assert r.board.current().configured and r.sup.status().pid == pid and r.sup.status().last_error == ""


def test_server_status_in_an_unknown_form_does_not_kill_the_daemon(make_config, run_supervisor, monkeypatch, caplog):
    r = run_supervisor(make_config(), gpu_indices=lambda: [0])
    r.wait_for(lambda s: s.configured)
    real = r.sup.control
    pid = r.sup.status().pid
    monkeypatch.setattr(r.sup, "control", lambda timeout=None: FaultyServers(real(timeout), "4242 2"))
    wait_until(lambda: r.sup.status().servers == (4242,), what="health check with a server")
    checks = r.sup.status().health_checks
    wait_until(lambda: r.sup.status().health_checks >= checks + 3, what="more health checks")
    assert r.sup.status().pid == pid and r.sup.status().restarts == 0
    assert r.board.current().configured and r.sup._faults.supports_status is False
    assert "FAULT detection off" in caplog.text and "'4242 2'" in caplog.text


@pytest.mark.every_mps_version
def test_stop_quits_the_daemon_and_restores_compute_mode(make_config, run_supervisor, tmp_path):
    log = tmp_path / "smi.log"
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f'#!/bin/sh\necho "$@" >> {log}\ncase "$1" in --query-gpu=*) echo "0, Default";; esac\n')
    smi.chmod(0o755)
    config = make_config(**{"exclusive-process": "true", "nvidia-smi": str(smi)})
    r = run_supervisor(config)
    r.wait_for(lambda s: s.configured)
    pid = r.sup.status().pid
    assert log.read_text().splitlines()[-1] == "-i 0 -c EXCLUSIVE_PROCESS"
    r.stop()
    assert r.result == [0]
    assert gone(pid)
    assert log.read_text().splitlines()[-1] == "-i 0 -c DEFAULT"
    assert not r.board.current().daemon_up


def test_setup_error_on_first_start_is_raised(make_config, run_supervisor, tmp_path):
    r = run_supervisor(make_config(**{"control-binary": str(tmp_path / "missing")}))
    r.thread.join(30)
    assert len(r.result) == 1 and "cannot start control binary" in str(r.result[0])


def test_defaults_that_do_not_read_back_are_reported_and_never_restart_the_daemon(
    make_config, run_supervisor, mps_control, tmp_path
):
    # A daemon that refuses a default mpsd sets (read back in the same session): a restart
    # would meet the same refusal, and end every tenant's server each time (issue 21, defect 1).
    wrapper = tmp_path / "rejecting-control"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'[ "$#" -gt 0 ] && exec {mps_control} "$@"\n'
        "sed 's/^set_default_active_thread_percentage .*/set_default_active_thread_percentage 250/' | "
        f"exec {mps_control}\n"
    )
    wrapper.chmod(0o755)
    config = make_config(**{"control-binary": str(wrapper), "active-thread-percentage": "50", "verdict-timeout": "1s"})
    r = run_supervisor(config)
    state = r.wait_for(lambda s: "reads back" in s.last_error, what="mismatch reported")
    assert "activeThreadPercentage 100 (config 50)" in state.last_error
    state = r.wait_for(lambda s: s.unverified, what="/readyz told after verdictTimeout")
    assert "activeThreadPercentage 100 (config 50)" in state.unverified
    assert r.sup.status().restarts == 0 and r.sup.status().failures_in_row == 0
    assert r.sup.status().defaults_restored == 0  # set again each round, never put back


def test_stop_with_a_hung_daemon_is_bounded(make_config, run_supervisor):
    config = make_config(**{"shutdown-timeout": "1s", "health-interval": "30s"})
    r = run_supervisor(config)
    r.wait_for(lambda s: s.configured)
    pid = r.sup.status().pid
    os.kill(pid, signal.SIGSTOP)  # quit gets no answer
    began = time.monotonic()
    r.stop(timeout=60)
    assert r.result == [0]
    assert time.monotonic() - began < 30
    wait_until(lambda: gone(pid), what="hung daemon killed at shutdown")

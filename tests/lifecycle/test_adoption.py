"""Adoption under ``daemonLifecycle: independent``, and the bad input around it, against the real
control daemon: what is adopted (and how it is then supervised: dies, hangs), what is refused
with one line and left as it was (an impostor, a daemon of another pipe dir or of another
version), what is replaced (files nobody answers), and mpsd's own failures, which leave the
daemon running."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from mpsd import config as cfg
from mpsd.daemon import genuine, peer
from mpsd.lifecycle import independent
from mpsd.daemon.control import MARK, Control
from mpsd.daemon.drift import settle
from mpsd.errors import SetupError
from tests.rollout import REPO, Node, read, stop, wait_until
from tests.daemon.test_genuine import dead, kill_and_reap, other_version, start

pytestmark = pytest.mark.mps_binary


@pytest.fixture
def config(make_config):
    return make_config(**{"daemon-lifecycle": "independent"})


@pytest.fixture
def leftovers(config):
    """Daemons left on the pipe dirs named here (mpsd leaves them running): killed at teardown."""
    pipe_dirs = [config.pipe_dir]
    yield pipe_dirs
    for pipe in pipe_dirs:
        while (pid := genuine.control_lock_holder(pipe)) is not None:
            kill_and_reap(pid)


def ready(state) -> bool:
    return state.daemon_up and state.configured


def logged(log: Path, text: str) -> str:
    """control.log once the daemon has written ``text`` to it (it may write after it answered)."""
    return wait_until(lambda: text in (content := log.read_text()) and content, f"{text!r} in {log}")


def lines(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def changes(sent: list[str]) -> list[str]:
    """The commands of ``sent`` that change something (not a read, not the batch marker mpsd's
    one-session reads end each answer with: mpsd.daemon.control.MARK, an unknown command)."""
    return [cmd for cmd in sent if not cmd.startswith("get_") and cmd != MARK]


def test_a_running_daemon_is_adopted_without_a_command_that_changes_it(config, leftovers, run_supervisor):
    config = cfg.replace(config, active_thread_percentage=50.0, client_priority=1)
    pid = start(config)
    settle(Control(config.control_binary, config.pipe_dir), config, set())  # what the mpsd before set
    log = Path(config.log_dir) / "control.log"
    before = logged(log, "Cmd:set_default_client_priority 1")
    r = run_supervisor(config)
    r.wait_for(ready, what="the daemon adopted")
    assert r.sup.status().pid == pid and r.sup.status().restarts == 0
    r.stop()
    sent = [line.split("Cmd:", 1)[1] for line in log.read_text()[len(before):].splitlines() if "Cmd:" in line]
    assert sent and changes(sent) == []  # reads only: same defaults, no quit
    assert not dead(pid)


def test_only_the_defaults_that_differ_are_set_at_adoption(config, leftovers, run_supervisor, caplog):
    caplog.set_level(logging.INFO, logger="mpsd")
    pid = start(config)
    control = Control(config.control_binary, config.pipe_dir)
    settle(control, cfg.replace(config, active_thread_percentage=50.0), set())  # another config's
    log = Path(config.log_dir) / "control.log"
    before = logged(log, "Cmd:set_default_active_thread_percentage 50")
    r = run_supervisor(cfg.replace(config, active_thread_percentage=60.0))
    r.wait_for(ready, what="the daemon adopted")
    assert r.sup.status().pid == pid and control.get_default_active_thread_percentage() == 60.0
    sent = [line.split("Cmd:", 1)[1] for line in log.read_text()[len(before):].splitlines() if "Cmd:" in line]
    assert changes(sent) == ["set_default_active_thread_percentage 60"]
    assert lines(caplog, "adopted daemon's defaults set to the config's (it had activeThreadPercentage 50 (config 60))")
    assert r.sup.status().defaults_restored == 0  # not tampering: the config changed


def test_an_adopted_daemon_that_dies_is_replaced_and_one_that_hangs_is_killed(config, leftovers, run_supervisor):
    first = start(config)
    r = run_supervisor(config)
    r.wait_for(ready, what="the daemon adopted")
    kill_and_reap(first)
    r.wait_for(lambda s: ready(s) and r.sup.status().pid not in (None, first), what="a new daemon")
    second = r.sup.status().pid
    assert genuine.control_lock_holder(config.pipe_dir) == second  # started detached: no holder here
    os.kill(second, signal.SIGSTOP)  # hung: not mpsd's child, killed through its pidfd
    r.wait_for(lambda s: ready(s) and r.sup.status().pid not in (None, second), timeout=60, what="the hung one replaced")
    wait_until(lambda: dead(second), "the hung daemon killed")
    assert r.sup.status().restarts == 2


def test_an_impostor_at_adoption_is_refused_counted_and_the_daemon_restarted(config, leftovers, run_supervisor,
                                                                               procs, caplog):  # fmt: skip
    genuine_pid = start(config)
    victim = subprocess.Popen(["sleep", "600"])
    procs.append(victim)
    impostor = subprocess.Popen([sys.executable, "-m", "tests.impostor", config.pipe_dir, str(victim.pid)],
                                cwd=REPO, stdout=subprocess.PIPE, text=True)  # fmt: skip
    procs.append(impostor)
    assert impostor.stdout.readline().strip() == "listening"
    r = run_supervisor(config)
    r.wait_for(lambda s: ready(s) and r.sup.status().pid not in (None, genuine_pid), what="a daemon of its own")
    assert r.sup.status().impostors >= 1
    found = lines(caplog, "control socket impostor at adoption")
    assert len(found) == 1 and f"pid {impostor.pid}" in found[0] and "not nvidia-cuda-mps-control" in found[0]
    assert lines(caplog, f"killed the daemon pid={genuine_pid} so that it binds its sockets again")
    wait_until(lambda: dead(genuine_pid), "the genuine daemon restarted")
    assert peer.listener_pid(os.path.join(config.pipe_dir, "control_privileged")) == r.sup.status().pid
    assert victim.poll() is None  # nothing the impostor said was acted on


def test_a_daemon_of_another_pipe_dir_is_refused_and_left_alone(make_config, config, leftovers, run_supervisor,
                                                                 caplog):  # fmt: skip
    other = make_config(**{"pipe-dir": str(Path(config.pipe_dir).parent / "other"), "daemon-lifecycle": "independent"})
    leftovers.append(other.pipe_dir)
    theirs = start(other)
    os.makedirs(config.pipe_dir)
    for name in ("control_privileged", "control"):
        os.link(os.path.join(other.pipe_dir, name), os.path.join(config.pipe_dir, name))
    r = run_supervisor(config)
    r.wait_for(lambda s: ready(s) and r.sup.status().pid not in (None, theirs), what="a daemon of its own")
    found = lines(caplog, "control socket impostor at adoption")
    assert len(found) == 1 and f"is the daemon of pipe dir {other.pipe_dir}, not of {config.pipe_dir}" in found[0]
    assert r.sup.status().impostors == 1
    assert not dead(theirs) and genuine.control_lock_holder(other.pipe_dir) == theirs  # not ours to touch


def test_a_stale_pipe_dir_whose_sockets_nobody_answers_gets_a_new_daemon(config, leftovers, run_supervisor, caplog):
    kill_and_reap(start(config))
    r = run_supervisor(config)
    r.wait_for(ready, what="a new daemon")
    assert lines(caplog, "nobody answers control_privileged (files of a daemon that is gone): replacing them")
    assert r.sup.status().impostors == 0 and r.sup.status().restarts == 0


def test_a_daemon_of_another_version_is_refused_once_and_left_running(config, leftovers, run_supervisor, caplog,
                                                                      tmp_path):  # fmt: skip
    theirs = tmp_path / "nvidia-cuda-mps-control"
    version = other_version(Path(config.control_binary), theirs)
    pid = start(cfg.replace(config, control_binary=str(theirs)))
    log = Path(config.log_dir) / "control.log"
    size = log.stat().st_size
    r = run_supervisor(config)
    r.wait_for(lambda s: f"nvidia-cuda-mps-control {version}" in s.last_error, what="the refusal")
    time.sleep(1.5)  # several retries (restartBackoffInitial 0.1s): said once
    found = lines(caplog, "control daemon not adopted")
    assert len(found) == 1, found
    assert f"runs nvidia-cuda-mps-control {version} ({theirs})" in found[0] and "mpsd stop-daemon" in found[0]
    assert not r.board.current().daemon_up and r.sup.status().impostors == 0
    assert genuine.control_lock_holder(config.pipe_dir) == pid and not dead(pid)
    assert "Cmd:" not in log.read_text()[size:]  # nothing sent to it


def test_mpsd_failing_leaves_the_daemon_running(config, leftovers, run_supervisor, monkeypatch):
    pid = start(config)
    r = run_supervisor(config)
    r.wait_for(ready, what="the daemon adopted")

    def crash() -> None:
        raise RuntimeError("a bug in mpsd")

    monkeypatch.setattr(r.sup, "_health_check", crash)
    r.thread.join(30)
    assert isinstance(r.result[0], RuntimeError)
    assert not dead(pid) and genuine.control_lock_holder(config.pipe_dir) == pid


def test_two_runs_at_once_on_a_running_daemon_one_adopts_it_the_other_says_who(mps_control, tmp_path_factory):
    node = Node(tmp_path_factory.mktemp("r"), mps_control)
    try:
        node.spawn("holder")
        daemon = wait_until(node.daemon_pid, "the holder's daemon")
        pair = [node.spawn("run"), node.spawn("run")]
        loser = wait_until(lambda: next((p for p in pair if p.poll() is not None), None), "one of them to exit")
        winner = next(p for p in pair if p is not loser)
        wait_until(node.ready, "the winner ready")
        out = [line for line in read(loser).splitlines() if not line[:4].isdigit()]  # not a log record
        assert loser.returncode == 1 and out == [
            f"mpsd: pipe dir {node.pipe}: another mpsd run (pid {winner.pid}) holds {node.lock('run')}; "
            "stop it or give this one another pipeDir"
        ], read(loser)
        assert stop(winner) == 0
        assert node.daemon_pid() == daemon and node.quits() == 0
    finally:
        node.close()


def test_owned_mode_refuses_a_running_daemon_with_one_line_saying_what_to_do(config, leftovers, run_supervisor):
    pid = start(config)
    r = run_supervisor(cfg.replace(config, daemon_lifecycle="owned"))
    r.thread.join(30)
    (error,) = r.result
    assert isinstance(error, SetupError) and "\n" not in str(error)
    assert f"another nvidia-cuda-mps-control (pid {pid} " in str(error) and "holds" in str(error)
    assert "stop it (mpsd stop-daemon), adopt it (daemonLifecycle: independent)" in str(error)
    assert not dead(pid) and genuine.control_lock_holder(config.pipe_dir) == pid


def test_in_a_service_or_a_pod_mpsd_waits_for_a_holder_instead_of_starting_a_daemon(config, run_supervisor,
                                                                                      monkeypatch):  # fmt: skip
    monkeypatch.setattr(independent, "_self_cgroup", lambda: "0::/system.slice/mpsd.service\n")
    r = run_supervisor(config)
    r.wait_for(lambda s: "start mpsd holder" in s.last_error, what="the wait")
    assert "mpsd runs in the systemd unit mpsd.service, which stops every process in it" in r.board.current().last_error
    time.sleep(1.0)
    assert genuine.control_lock_holder(config.pipe_dir) is None and not r.board.current().daemon_up
    holder = subprocess.Popen([sys.executable, "-m", "mpsd", "holder", f"--control-binary={config.control_binary}",
                               f"--pipe-dir={config.pipe_dir}", f"--log-dir={config.log_dir}"], cwd=REPO)  # fmt: skip
    try:
        r.wait_for(ready, what="the holder's daemon adopted")
        assert psutil.Process(r.sup.status().pid).ppid() == holder.pid
    finally:
        assert stop(holder) == 0


def test_a_held_session_does_not_get_an_adopted_daemon_killed(config, leftovers, run_supervisor):
    from tests.mpsfixtures import FrontEndHolder

    pid = start(config)
    r = run_supervisor(config)
    r.wait_for(ready, what="the daemon adopted")
    held = FrontEndHolder(config.control_binary, config.pipe_dir)
    try:
        wait_until(lambda: "held by" in r.sup.status().last_error, "an inconclusive check naming the holder")
        assert f"pid {held.proc.pid}" in r.sup.status().last_error  # read from the adopted daemon's descriptors
        assert r.sup.status().pid == pid and not dead(pid)
    finally:
        held.release()
    wait_until(lambda: r.sup.status().last_error == "" and r.board.current().daemon_up, "a conclusive check again")
    assert r.sup.status().pid == pid and r.sup.status().restarts == 0

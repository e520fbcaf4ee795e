"""The progress line of a run (issue #44 defect 8): it names the phase, counts what is known and gives an ETA,
read against a fake wall clock."""

import io
import threading

from harness.run.progress import GENERATING, RUNNING, RunProgress, eta_text, expected_requests, for_scenario, \
    print_progress
from harness.scenario import parse_scenario


class FakeWall:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_generation_names_its_phase_and_counts_the_requests_made_of_those_expected():
    wall = FakeWall()
    p = RunProgress(end_s=60.0, expected=24_000, wall=wall)
    assert p.phase == GENERATING and p.line() == "generating the workload: 0 requests so far (of ~24,000), 0s"
    p.generated(4)
    p.generated(12_340)
    wall.t += 25
    assert p.line() == "generating the workload: 12,344 requests so far (of ~24,000), 25s"
    assert RunProgress(wall=wall).line() == "generating the workload: 0 requests so far, 0s"  # a trace: no total


def test_running_gives_counts_scenario_time_speed_and_an_eta_from_virtual_time_progress():
    wall = FakeWall()
    p = RunProgress(end_s=60.0, wall=wall)
    wall.t += 25  # generating
    p.running(0, 0, 24_216)
    assert p.phase == RUNNING
    assert p.line() == "running: 0/24,216 requests, t=0s of 1m00s, ETA --"  # no rate measured yet
    wall.t += 4
    p.running(20 * 10**9, 6_000, 24_216)  # a third of the scenario time in 4 s: 8 s to go
    assert p.fraction() == 20 / 60
    assert p.line() == "running: 6,000/24,216 requests, t=20s of 1m00s, 5.0x real time, ETA 8s"
    wall.t += 3  # no news for 3 s: the ETA counts down, the speed stays what was measured
    assert p.line() == "running: 6,000/24,216 requests, t=20s of 1m00s, 5.0x real time, ETA 5s"
    wall.t += 9
    p.running(65 * 10**9, 24_000, 24_216)  # past the last arrival: the requests done measure the rest (drain)
    assert p.fraction() == 24_000 / 24_216
    assert p.line() == "running: 24,000/24,216 requests, t=1m05s of 1m00s, 4.1x real time, ETA 0s"  # 65 s in 16 s


def test_without_the_workloads_end_the_eta_comes_from_the_requests_done():
    wall = FakeWall()
    p = RunProgress(wall=wall)
    p.running(0, 0, 1_000)
    wall.t += 10
    p.running(30 * 10**9, 250, 1_000)
    assert p.line() == "running: 250/1,000 requests, t=30s, 3.0x real time, ETA 30s"


def test_a_phase_in_between_is_named_with_its_time():
    wall = FakeWall()
    p = RunProgress(wall=wall)
    p.enter("waiting for the router (926 requests made)")
    wall.t += 3
    assert p.line() == "waiting for the router (926 requests made), 3s"


def test_eta_format():
    assert [eta_text(s) for s in (None, 0, 44.6, 185, 3725)] == ["ETA --", "ETA 0s", "ETA 45s", "ETA 3m05s",
                                                                   "ETA 1h02m"]


def test_what_is_known_before_the_run_comes_from_the_scenario():
    synthetic = parse_scenario("""
name: p
workload: {kind: synthetic, rate_rps: 100, turns: 4, sub_agents: 1}
run: {duration_s: 60}
""")
    assert expected_requests(synthetic) == 100 * 60 * 4 * 2
    p = for_scenario(synthetic)
    assert p.end_s == 60.0 and p.expected == 48_000


def test_printed_lines_start_at_once_and_stop_when_told():
    out = io.StringIO()
    p = RunProgress(expected=10)
    stop = print_progress(p, "kvemu loadgen", 60.0, out)
    done = threading.Event()
    for _ in range(200):
        if out.getvalue():
            done.set()
            break
        threading.Event().wait(0.01)
    stop.set()
    assert done.is_set() and out.getvalue().startswith("kvemu loadgen: generating the workload: 0 requests so far")


def test_a_live_run_whose_first_news_comes_late_runs_at_real_time_not_faster():
    """The load generator's first sample comes a moment into the run: speed and ETA count from it."""
    wall = FakeWall()
    p = RunProgress(end_s=30.0, wall=wall)
    p.running(1_200_000_000, 10, 926)
    wall.t += 4
    p.running(5_200_000_000, 150, 926)
    assert p.line() == "running: 150/926 requests, t=5s of 30s, 1.0x real time, ETA 25s"

"""A node lost mid-step and during the all-gather of the new weights, many times (issue 45):
2 simulated nodes x 2 ranks in the split layout on this host, saving at step 2 of 4; rank
2 (node 1's first) is killed (SIGKILL) at step 3 either between its backward and its
update (`backward`) or once its update has started sending a group's new weights to node
0 (`exchange`). Per launch: whether every rank stopped, the seconds from the kill to the
last node's exit, whether both of node 0's ranks raised an error naming rank 2 of node 1,
whether /dev/shm is as before, and whether a fresh launch from the step-2 checkpoint ends
bit for bit as a run never killed (losses of steps 3-4, every rank's weights and state).

    PYTHONPATH=. python bench/node_faults.py [--repeats 5] [--when backward exchange]

The launches and their checks are the integration tests' (integration_tests/
test_node_store_launch.py: `test_a_node_killed_*`), repeated.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from integration_tests import test_node_store_launch as launches  # noqa: E402


def killed_launch(work: Path, when: str, full: launches.SplitRun) -> dict[str, object]:
    """One launch killed at step 3 (`when`), then its checkpoint resumed: what it showed."""
    killed = launches.kill_rank_2(work, *launches.SPLIT_CKPT_ARGS, "--save-at", "2",
                                  "--ckpt-dir", str(work / "ckpt"), "--kill-step", "3",
                                  "--kill-when", when)
    if not killed.named:  # what node 0's ranks raised instead
        print(killed.node_0_output[-12000:], file=sys.stderr)
    resumed = launches._launch_nodes(work, "resumed", *launches.SPLIT_CKPT_ARGS,
                                     "--resume-from", str(work / "ckpt"), "--digest-out",
                                     str(work / "resumed_"), env=launches.SPLIT_ENV)
    exact = (resumed == full.losses[2:]
             and launches._digests(work / "resumed_") == full.digests)
    return {"stopped": killed.stopped, "stop_s": killed.stop_s, "named": killed.named,
            "shm_clean": killed.shm_clean, "exact": exact}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--when", nargs="+", default=["backward", "exchange"],
                        choices=["backward", "exchange"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="lazytrain-node-faults-") as tmp:
        work = Path(tmp)
        (work / "full").mkdir()
        full = launches.split_full_run(work / "full")
        print("| killed | launch | every rank stopped | kill to exit (s) | node 0 names "
              "rank 2 | /dev/shm clean | resume bit-exact |")
        print("|---|---|---|---|---|---|---|")
        for when in args.when:
            for i in range(args.repeats):
                run = work / f"{when}{i}"
                run.mkdir()
                r = killed_launch(run, when, full)
                print(f"| {when} | {i + 1} | {r['stopped']} | {r['stop_s']:.1f} | "
                      f"{r['named']} | {r['shm_clean']} | {r['exact']} |", flush=True)
                print(json.dumps(r), file=sys.stderr)


if __name__ == "__main__":
    main()

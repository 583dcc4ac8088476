"""One rank of benchmarks/heartbeat.py's healthy job: an elastic loop of one all-reduce of ``--mib`` MiB a step.

At step ``--busy-step`` the rank ``--busy-rank`` computes for ``--busy-s`` seconds in pure Python (a long
compute step that holds the interpreter but lets its other threads run).  Rank 0 prints one line a step
(``step N T``, T seconds since the start) and the job's end; a re-forming is printed by hpctrain.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import hpctrain
import hpctrain.elastic


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seconds", type=float, default=600.0, help="train this long (then every rank stops together)")
    p.add_argument("--mib", type=float, default=1.0, help="MiB all-reduced a step")
    p.add_argument("--busy-rank", type=int, default=3)
    p.add_argument("--busy-step", type=int, default=20)
    p.add_argument("--busy-s", type=float, default=60.0)
    p.add_argument("--step-sleep", type=float, default=0.2)
    args = p.parse_args()
    hpctrain.init()
    start = time.time()
    values = np.ones(int(args.mib * (1 << 20)) // 4, dtype=np.float32)
    state = hpctrain.elastic.ObjectState(step=0)

    @hpctrain.elastic.run
    def train(state):
        w = hpctrain.world()
        while True:
            # (every rank stops at the same step: rank 0's clock decides, sent with the step's data)
            values[0] = 1.0 if time.time() - start < args.seconds or w.rank else 0.0
            total = w.allreduce(values)
            if state.step == args.busy_step and w.rank == args.busy_rank:
                end = time.perf_counter() + args.busy_s
                while time.perf_counter() < end:
                    sum(i * i for i in range(1000))
            state.step += 1
            if w.rank == 0:
                print(f"step {state.step} {time.time() - start:.2f}", flush=True)
            if total[0] < w.size:
                return
            state.commit()
            time.sleep(args.step_sleep)

    train(state)
    if hpctrain.world().rank == 0:
        print(f"finished {state.step} steps with {hpctrain.world().size} ranks", flush=True)


if __name__ == "__main__":
    main()

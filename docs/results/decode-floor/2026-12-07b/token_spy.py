"""Why the default drafter's lookup plans are built after the read, inside ``device_sim.py``: for each read whose
real plan was a lookup chain and ran no build, whether a plan by token was guessed for its outcome, whether the
read's token was among the candidates, whether it was built, and whether its plan was the real one.

Usage: ``python docs/results/decode-floor/2026-12-07b/token_spy.py [metal|free|measured] [prompts] [temperature]``."""

import collections
import runpy
import sys

import ptp_mlx  # noqa
import ptp_mlx.decode.pipeline as pl

C = collections.Counter()
_bc = pl.build_chained


def bc(sess, drafter, running, max_new, ctx, kinds, confirmed):
    out = _bc(sess, drafter, running, max_new, ctx, kinds, confirmed)
    C[f"kinds={kinds}"] += 1
    if out is not None:
        C["by_token guessed" if any(x is not None for x in out.by_token) else "no by_token guess"] += 1
        C[
            "by_token built"
            if any(
                x is not None and x.by_token is not None
                for b in [out.guesses] + [o.guesses for o in out.others]
                for x in b
            )
            else "not built"
        ] += 1
    return out


pl.build_chained = bc
_conf = pl.CallQueue.confirm


def conf(q, result, plan, i):
    ch = q.chained
    ok = _conf(q, result, plan, i)
    if (
        ch is not None
        and not ok
        and plan is not None
        and plan.source == "lookup"
        and result.strand is None
        and not plan.burst
    ):
        bt = ch.by_token[result.accepted] if ch.by_token and result.accepted < len(ch.by_token) else None
        if bt is None:
            C["miss lookup: no by_token guess for outcome"] += 1
        else:
            tok = result.block[-1]
            if tok not in bt.by_token:
                C["miss lookup: token not among candidates"] += 1
            else:
                built = any(x is not None and x is bt for b in [ch.guesses] + [o.guesses for o in ch.others] for x in b)
                C[f"miss lookup: token guessed, built={built}, plan equal={bt.by_token[tok] == plan}"] += 1
    return ok


pl.CallQueue.confirm = conf
sys.argv = ["device_sim.py"] + sys.argv[1:]
runpy.run_path("docs/results/decode-floor/device_sim.py", run_name="__main__")
for k, v in sorted(C.items()):
    print(k, v)

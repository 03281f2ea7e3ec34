"""Fork a prepared sandbox into N children, run a different "policy" in each, and print
what each scored.

    AENV_SERVER=http://127.0.0.1:8000 AENV_API_KEY=$(cat /var/lib/agentenv/api_key) \\
        python examples/rollout.py --n 4

The server and key come from AENV_SERVER / AENV_API_KEY, or E2B_API_URL / E2B_API_KEY.
"""

from __future__ import annotations

import argparse

import e2b

from agentenv.client import AgentEnv, rollout

TASK = "/home/user/task"


def policy(child: e2b.Sandbox, index: int) -> int:
    """Child ``index``'s attempt at the task: a guess biased by the index, scored
    against the target the parent wrote before the fork."""
    guess = f"$(( (RANDOM + {index}) % 10 ))"
    run = child.commands.run(
        f"echo {guess} > /home/user/score; "
        f"echo $(( 10 - ( $(cat /home/user/score) - $(cat {TASK}) ) ** 2 ))"
    )
    return int(run.stdout.strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=3, help="number of children (1..20)")
    parser.add_argument("--template", default="base", help="template to start from")
    args = parser.parse_args()

    with AgentEnv() as client:
        parent = client.create(template=args.template, timeout=300)
        try:
            # The state every child starts from: a target to guess, and the parent's memory.
            parent.commands.run(f"echo $((RANDOM % 10)) > {TASK}")
            print(f"parent {parent.sandbox_id}: target written to {TASK}")
            results = rollout(client, parent, args.n, policy, after="kill", timeout=300)
        finally:
            client.kill(parent)

    print(f"{'child':>5}  {'sandbox':<24}  {'score':>5}  {'seconds':>7}")
    for result in results:
        score = str(result.value) if result.ok else f"error: {result.error}"
        print(
            f"{result.index:>5}  {result.sandbox_id or '-':<24}  {score:>5}  {result.seconds:7.2f}"
        )
    scored = [r for r in results if r.ok and r.value is not None]
    if scored:
        best = max(scored, key=lambda r: r.value or 0)
        print(f"best: child {best.index} with score {best.value}")


if __name__ == "__main__":
    main()

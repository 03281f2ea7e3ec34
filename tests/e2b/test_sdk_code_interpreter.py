"""The unmodified ``e2b-code-interpreter`` SDK (2.11.5) against the built-in
``code-interpreter-v1`` template: state between calls, rich results (a matplotlib PNG
among them), errors, streamed callbacks, contexts (Python and bash), per-call
environment variables, timeouts interrupting the kernel, a kernel that dies, sync and
async clients, pause/resume keeping the kernel's state, and a fork of four children
that share the parent's state and diverge after.

The first test builds the template if this server has none: the code-interpreter root
filesystem is cached in the image cache, the snapshot is per server."""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import time
from collections.abc import Iterator
from typing import Any

import pytest
from e2b import SandboxException, TimeoutException
from e2b_code_interpreter import E2B as InterpreterE2B
from e2b_code_interpreter import AsyncSandbox, OutputMessage, Result, Sandbox

from tests.e2b.support import sdk_opts
from tests.helpers import ServerProcess

pytestmark = pytest.mark.vm

TEMPLATE = "code-interpreter-v1"


@pytest.fixture(scope="module")
def ci(e2b_server: ServerProcess) -> InterpreterE2B:
    return InterpreterE2B(**sdk_opts(e2b_server))


@pytest.fixture(scope="module")
def sbx(ci: InterpreterE2B) -> Iterator[Sandbox]:
    started = time.monotonic()
    # The first create of the template on a node builds it: minutes under TCG.
    sandbox = ci.Sandbox.create(timeout=900, request_timeout=1800)
    print(
        f"create of {TEMPLATE} (template build included if new) {time.monotonic() - started:.1f}s"
    )
    yield sandbox
    sandbox.kill()


def test_state_between_calls_and_execution_count(sbx: Sandbox) -> None:
    assert sbx.get_info().template_id == TEMPLATE
    started = time.monotonic()
    first = sbx.run_code("x = 41")
    print(f"first run_code {time.monotonic() - started:.2f}s")
    assert first.error is None and first.results == []
    second = sbx.run_code("x + 1")
    assert second.text == "42"
    assert [r.is_main_result for r in second.results] == [True]
    assert first.execution_count is not None and second.execution_count == first.execution_count + 1
    # The warm modules are there, not named in the user's namespace.
    assert sbx.run_code("import pandas as pd; pd.__name__").text == "'pandas'"
    assert sbx.run_code("'numpy' in dir()").text == "False"


def test_rich_results(sbx: Sandbox) -> None:
    execution = sbx.run_code(
        "from IPython.display import display, HTML, Markdown, Latex, JSON, SVG\n"
        "display(HTML('<b>bold</b>'))\n"
        "display(Markdown('# title'))\n"
        "display(Latex(r'$x^2$'))\n"
        "display(JSON({'a': [1, 2]}))\n"
        'display(SVG(\'<svg xmlns="http://www.w3.org/2000/svg" width="4" height="4"/>\'))\n'
        "import pandas as pd\n"
        "pd.DataFrame({'a': [1, 2], 'b': [3, 4]})\n"
    )
    assert execution.error is None
    html, markdown, latex, json_result, svg, frame = execution.results
    assert html.html == "<b>bold</b>" and not html.is_main_result
    assert markdown.markdown == "# title"
    assert latex.latex == "$x^2$"
    assert json_result.json == {"a": [1, 2]}
    assert svg.svg is not None and svg.svg.startswith("<svg")
    assert frame.is_main_result and frame.html is not None and "<table" in frame.html
    assert frame.text is not None and "a  b" in frame.text


def test_matplotlib_figure_is_a_png(sbx: Sandbox) -> None:
    execution = sbx.run_code(
        "import matplotlib.pyplot as plt\n"
        "plt.plot([1, 2, 3], [3, 1, 2])\n"
        "plt.title('t')\n"
        "plt.show()\n"
    )
    assert execution.error is None
    pngs = [r.png for r in execution.results if r.png]
    assert len(pngs) == 1
    assert base64.b64decode(pngs[0]).startswith(b"\x89PNG\r\n\x1a\n")


def test_errors(sbx: Sandbox) -> None:
    seen: list[Any] = []
    execution = sbx.run_code("print('before')\n1 / 0", on_error=seen.append)
    assert execution.logs.stdout == ["before\n"]
    assert execution.error is not None
    assert execution.error.name == "ZeroDivisionError"
    assert execution.error.value == "division by zero"
    assert "ZeroDivisionError" in execution.error.traceback
    assert seen == [execution.error]
    # The context keeps working after an error.
    assert sbx.run_code("x").text == "41"


def test_streaming_callbacks(sbx: Sandbox) -> None:
    stdout: list[OutputMessage] = []
    stderr: list[OutputMessage] = []
    results: list[Result] = []
    execution = sbx.run_code(
        "import sys, time\n"
        "for i in range(3):\n"
        "    print(f'out {i}', flush=True)\n"
        "    time.sleep(0.2)\n"
        "print('err', file=sys.stderr, flush=True)\n"
        "7 * 6\n",
        on_stdout=stdout.append,
        on_stderr=stderr.append,
        on_result=results.append,
    )
    assert "".join(m.line for m in stdout) == "out 0\nout 1\nout 2\n"
    assert len(stdout) >= 2  # streamed as printed, not in one piece at the end
    assert all(not m.error and m.timestamp > 0 for m in stdout)
    assert [m.line for m in stderr] == ["err\n"] and stderr[0].error
    assert [r.text for r in results] == ["42"] == [r.text for r in execution.results]


def test_contexts_python_and_bash(sbx: Sandbox) -> None:
    context = sbx.create_code_context(cwd="/tmp")
    assert context.language == "python" and context.cwd == "/tmp"
    assert sbx.run_code("import os; os.getcwd()", context=context).text == "'/tmp'"
    # Its own state: the default context's x is not there.
    assert sbx.run_code("x", context=context).error.name == "NameError"
    sbx.run_code("y = 5", context=context)
    assert sbx.run_code("y", context=context).text == "5"
    assert context.id in [c.id for c in sbx.list_code_contexts()]
    sbx.restart_code_context(context)
    assert sbx.run_code("y", context=context).error.name == "NameError"
    sbx.remove_code_context(context.id)
    assert context.id not in [c.id for c in sbx.list_code_contexts()]

    shell = sbx.create_code_context(language="bash")
    assert shell.language == "bash" and shell.cwd == "/home/user"
    sbx.run_code("cd /tmp; N=3", context=shell)
    out = sbx.run_code("echo $N $(pwd); echo oops >&2; false", context=shell)
    assert out.logs.stdout == ["3 /tmp\n"] and out.logs.stderr == ["oops\n"]
    assert out.error is not None and out.error.value == "exit status 1"
    # The default bash context, by language.
    assert sbx.run_code("echo $((6 * 7))", language="bash").logs.stdout == ["42\n"]
    with pytest.raises(SandboxException, match="not supported"):
        sbx.run_code("1", language="r")


def test_env_vars_apply_to_one_call(sbx: Sandbox) -> None:
    code = "import os; str(os.environ.get('CI_VAR'))"
    assert sbx.run_code(code, envs={"CI_VAR": "set"}).text == "'set'"
    assert sbx.run_code(code).text == "'None'"
    out = sbx.run_code("echo ${CI_VAR:-unset}", language="bash", envs={"CI_VAR": "b"})
    assert out.logs.stdout == ["b\n"]
    assert sbx.run_code("echo ${CI_VAR:-unset}", language="bash").logs.stdout == ["unset\n"]


def test_timeout_interrupts_the_kernel(sbx: Sandbox) -> None:
    with pytest.raises(TimeoutException):
        sbx.run_code("import time\ntime.sleep(120)\nfinished = True", timeout=5)
    # The client's disconnect interrupted the cell: it never reached its last line, and
    # the context answers the next call (it would wait out the sleep otherwise).
    after = sbx.run_code("'finished' in dir()")
    assert after.text == "False"


def test_a_dead_kernel_is_an_error_and_restarts(sbx: Sandbox) -> None:
    context = sbx.create_code_context()
    sbx.run_code("z = 1", context=context)
    died = sbx.run_code("import os; os._exit(1)", context=context)
    assert died.error is not None and died.error.name == "KernelDied"
    again = sbx.run_code("'z' in dir()", context=context)
    assert again.error is None and again.text == "False"
    sbx.remove_code_context(context)


def test_async_client(e2b_server: ServerProcess, sbx: Sandbox) -> None:
    async def scenario() -> None:
        sandbox = await AsyncSandbox.connect(sbx.sandbox_id, **sdk_opts(e2b_server))
        lines: list[str] = []

        async def on_stdout(message: OutputMessage) -> None:
            lines.append(message.line)

        execution = await sandbox.run_code("print('hi'); x * 2", on_stdout=on_stdout)
        assert lines == ["hi\n"] and execution.text == "82"
        context = await sandbox.create_code_context(language="python")
        await sandbox.run_code("w = 'async'", context=context)
        assert (await sandbox.run_code("w", context=context)).text == "'async'"
        assert context.id in [c.id for c in await sandbox.list_code_contexts()]
        await sandbox.remove_code_context(context)
        with pytest.raises(TimeoutException):
            await sandbox.run_code("import time; time.sleep(120)", timeout=5)
        assert (await sandbox.run_code("1 + 1")).text == "2"

    asyncio.run(scenario())


def test_pause_and_resume_keep_kernel_state(ci: InterpreterE2B, sbx: Sandbox) -> None:
    sbx.run_code("import numpy as np\nkept = np.arange(10)")
    assert sbx.pause() is True
    back = ci.Sandbox.connect(sbx.sandbox_id)
    assert back.run_code("int(kept.sum()) + x").text == str(45 + 41)


def test_fork_children_share_kernel_state_and_diverge(
    ci: InterpreterE2B, e2b_server: ServerProcess
) -> None:
    parent = ci.Sandbox.create(timeout=600)
    children: list[str] = []
    try:
        parent.run_code("import pandas as pd\nshared = pd.DataFrame({'v': range(1, 101)})")
        with e2b_server.client() as c:
            forked = c.post(f"/sandboxes/{parent.sandbox_id}/fork", json={"count": 4})
        assert forked.status_code == 201, forked.text
        children = [item["sandbox"]["sandboxID"] for item in forked.json()]
        assert len(children) == 4

        def compute(index_and_id: tuple[int, str]) -> tuple[str | None, str | None]:
            index, child_id = index_and_id
            child = ci.Sandbox.connect(child_id)
            # Each child computes something different from the shared frame...
            mine = child.run_code(f"mine = int((shared.v ** {index + 1}).sum())\nmine").text
            # ...and its own state stays its own.
            return mine, child.run_code("mine").text

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(compute, enumerate(children)))
        expected = [str(sum(v ** (i + 1) for v in range(1, 101))) for i in range(4)]
        assert [a for a, _ in answers] == expected
        assert [b for _, b in answers] == expected
        # The parent never saw the children's variables.
        assert parent.run_code("'mine' in dir()").text == "False"
        assert parent.run_code("int(shared.v.sum())").text == "5050"
    finally:
        for child_id in children:
            ci.Sandbox.kill(child_id)
        parent.kill()

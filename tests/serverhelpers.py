"""A real uvicorn server on 127.0.0.1 in a background thread, serving a tiny model, for the tests.

The server's event loop owns the engine (its actors run there); tests reach the engine through
:meth:`RunningServer.call`, which runs a coroutine on that loop and waits for it, bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runahead.engine import Engine
from runahead.server import ServerConfig, build_server, create_app

from modelhelpers import build_tiny_model

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ {'system': 'w250', 'developer': 'w250', 'user': 'w251', 'assistant': 'w252', 'tool': 'w249'}"
    "[message['role']] }} {{ message['content'] }} </s> "
    "{% endfor %}"
    "{% if add_generation_prompt %}w252{% endif %}"
)
"""A chat template over the tiny word-level vocabulary: a role word, the content, then ``</s>``."""

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0


def build_chat_model(path: str | Path, **overrides: Any) -> Path:
    """A tiny qwen3_moe model whose tokenizer has :data:`CHAT_TEMPLATE` (saved in the folder);
    ``overrides`` change its config (``max_position_embeddings`` for a short context)."""
    from transformers import AutoTokenizer

    path = build_tiny_model("qwen3_moe", path, **overrides)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


@dataclass
class RunningServer:
    """A started server: its port, its engine and the loop they run on."""

    port: int
    engine: Engine
    loop: asyncio.AbstractEventLoop
    server: Any  # uvicorn.Server

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def call(self, coroutine: Coroutine[Any, Any, Any], timeout: float = 30.0) -> Any:
        """Run ``coroutine`` on the server's loop (where the engine lives); return its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def engine_is_quiet(self) -> bool:
        """No request open in the backend or the runtime, and no expert pinned in the cache."""

        async def check() -> bool:
            runtime = self.engine.runtime
            return (
                runtime.cache.is_idle()
                and not runtime.backend._requests  # type: ignore[attr-defined]
                and not runtime.handles
            )

        return bool(self.call(check()))

    def wait_until_quiet(self, timeout: float = 10.0) -> bool:
        """Poll :meth:`engine_is_quiet` until it holds or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.engine_is_quiet():
                return True
            time.sleep(0.02)
        return self.engine_is_quiet()


@contextlib.contextmanager
def running_server(
    model: str | Path, model_name: str = "tiny", config: ServerConfig | None = None, **engine_options: Any
) -> Iterator[RunningServer]:
    """Serve ``model`` on a free 127.0.0.1 port in a background thread until the block ends."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)  # connections queue until uvicorn serves them
    started = threading.Event()
    box: dict[str, Any] = {}

    async def main() -> None:
        engine = await Engine.open(str(model), **engine_options)
        try:
            server = build_server(create_app(engine, model_name, config=config), log_level="warning")
            box.update(engine=engine, server=server, loop=asyncio.get_running_loop())
            started.set()
            await server.serve(sockets=[listener])
        finally:
            await engine.close()

    def thread_main() -> None:
        try:
            asyncio.run(main())
        except BaseException as error:
            box["error"] = error
        finally:
            started.set()

    thread = threading.Thread(target=thread_main, name="uvicorn-test-server", daemon=True)
    thread.start()
    if not started.wait(START_TIMEOUT_S) or "error" in box:
        raise RuntimeError(f"the test server did not start: {box.get('error')!r}")
    running = RunningServer(listener.getsockname()[1], box["engine"], box["loop"], box["server"])
    deadline = time.monotonic() + START_TIMEOUT_S
    while not running.server.started and time.monotonic() < deadline and thread.is_alive():
        time.sleep(0.01)
    try:
        yield running
    finally:
        running.server.should_exit = True
        thread.join(STOP_TIMEOUT_S)
        listener.close()
        if thread.is_alive():
            raise RuntimeError("the test server did not stop")
        if "error" in box:
            raise RuntimeError(f"the test server failed: {box['error']!r}")

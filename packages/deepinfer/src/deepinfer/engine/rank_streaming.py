"""Inside a data-parallel rank: the outputs so far of the requests the front streams, taken after each step.

The front (`data_parallel.py`) asks for them per batch of requests it sends, when an `AsyncLLM` drives it;
`LLM.generate` needs only the finished outputs and pays nothing. A request gets a snapshot (as `AsyncLLM`
takes of a single engine's requests, `streaming.snapshot`) after each step that gave it tokens; the front
keeps the latest one until the finished output replaces it.
"""

from __future__ import annotations

from ..outputs import RequestOutput
from ..streaming import snapshot


class StreamedRequests:
    def __init__(self) -> None:
        self._reported: dict[str, int] = {}  # request id -> generated tokens in its last snapshot

    def add(self, request_id: str) -> None:
        self._reported[request_id] = 0

    def take(self, engine, finished: list[RequestOutput]) -> list[RequestOutput]:
        """Snapshots of the streamed requests that gained tokens since the last call; the requests in
        `finished` (and any the engine no longer holds: aborted, their output still to come) leave."""
        for out in finished:
            self._reported.pop(out.request_id, None)
        out = []
        for request_id, seen in list(self._reported.items()):
            state = engine.requests.get(request_id)
            if state is None:
                del self._reported[request_id]
                continue
            generated = sum(s.num_generated for s in state.seqs)
            if generated != seen:
                self._reported[request_id] = generated
                out.append(snapshot(state))
        return out

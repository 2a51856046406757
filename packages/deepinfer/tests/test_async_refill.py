"""`AsyncLLM`'s refill wait: in the asynchronous loop, a request added by the client of one that just
finished joins the very next scheduled step, not the one after; the wait never holds back an abort,
nor a request while no step is in flight (an idle engine, the synchronous loop).

Steps are counted with `engine.stats.steps` read in a delivery listener (on the event loop, between
steps). The tests that must not wait set REFILL_WAIT_FRACTION so high that any wait would outlast
their time limit; the one that must, high enough that its client (on the same event loop) always
comes in time on a loaded machine."""

import asyncio

import pytest
from deepinfer import AsyncLLM, EngineArgs, LLMEngine, SamplingParams
from deepinfer import async_llm as async_llm_module

PROMPT = [0, 40, 77, 91, 12, 300, 5]
ENGINE = dict(block_size=16, max_model_len=256)
NEVER_ENDING = 1e9  # times the last step's time: a wait that no test outlives
GENEROUS = 20.0  # a wait that ends by its bound (a finish with no replacement) still costs only steps
LIMIT_S = 120  # a request held back by a wait that should not happen fails its test after this


@pytest.fixture
def make_async(micro_checkpoint, share_loaded_models):
    def make(**engine_args):
        args = EngineArgs(model=str(micro_checkpoint), **ENGINE, **engine_args)
        return AsyncLLM.from_engine(LLMEngine.from_engine_args(args))

    return make


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


class _StepsAtDelivery:
    """The engine's committed step count at each request's first token and at its finish."""

    def __init__(self, llm: AsyncLLM) -> None:
        self.llm, self.first, self.finish = llm, {}, {}
        llm.listeners.append(self)

    def __call__(self, out, new_tokens, gap, now) -> None:
        steps = self.llm.engine.stats.steps
        if new_tokens and out.request_id not in self.first:
            self.first[out.request_id] = steps
        if out.finished:
            self.finish[out.request_id] = steps


async def _within(aw, what: str):
    """`aw`'s result, failing the test if it takes longer than LIMIT_S (without cancelling it: a
    stream's consumer cancelled while the loop held its abort back would not end either)."""
    task = asyncio.ensure_future(aw)
    done, _ = await asyncio.wait({task}, timeout=LIMIT_S)
    assert done, what
    return task.result()


async def _drain(llm: AsyncLLM, request_id: str, params: SamplingParams):
    return [
        out
        async for out in llm.generate(prompt_token_ids=PROMPT, sampling_params=params, request_id=request_id)
    ]


def _replacement_after_finish(make_async, fraction: float, monkeypatch) -> tuple[int, int]:
    """A long request runs; a short one finishes and its client at once adds the next. Returns the steps
    between the short request's finish and the next one's first token, and the long request's step count
    at its finish (unchanged by the wait)."""
    monkeypatch.setattr(async_llm_module, "REFILL_WAIT_FRACTION", fraction)

    async def run():
        async with make_async() as llm:
            steps = _StepsAtDelivery(llm)
            long = asyncio.ensure_future(_drain(llm, "long", _params(24)))

            async def client():
                await _drain(llm, "short", _params(3))
                await _drain(llm, "next", _params(3))

            await _within(client(), "a request took longer than LIMIT_S")
            await _within(long, "a request took longer than LIMIT_S")
            return steps

    steps = asyncio.run(run())
    return steps.first["next"] - steps.finish["short"], steps.finish["long"]


def test_a_request_added_after_a_finish_joins_the_next_scheduled_step(make_async, monkeypatch):
    waited, long_steps = _replacement_after_finish(make_async, GENEROUS, monkeypatch)
    # step N finished "short" while N+1 was already running: "next" is admitted before N+2 is
    # scheduled, prefilled in N+2 and its first token delivered once N+2 is committed
    assert waited == 2
    no_wait, long_steps_without = _replacement_after_finish(make_async, 0.0, monkeypatch)
    assert no_wait == 3  # without the wait it misses N+2 (what the wait is for)
    assert long_steps == long_steps_without  # the long request's steps are the same


def test_an_abort_ends_the_wait_at_once(make_async, monkeypatch):
    monkeypatch.setattr(async_llm_module, "REFILL_WAIT_FRACTION", NEVER_ENDING)

    async def run():
        async with make_async() as llm:
            steps = _StepsAtDelivery(llm)
            long = asyncio.ensure_future(_drain(llm, "long", _params(200)))
            await _within(_drain(llm, "short", _params(3)), "a request took longer than LIMIT_S")
            finished_at = steps.finish["short"]
            assert llm.abort("long")  # instead of a next request: the loop waits for one
            outs = await _within(long, "the abort waited for a replacement request")
            return outs[-1], finished_at, steps

    last, finished_at, steps = asyncio.run(run())
    assert last.outputs[0].finish_reason == "abort"
    assert len(last.outputs[0].token_ids) < 200
    # applied before the step after the one in flight: the loop stepped on without waiting
    assert steps.finish["long"] == finished_at + 1


def test_no_wait_in_an_idle_engine(make_async, monkeypatch):
    monkeypatch.setattr(async_llm_module, "REFILL_WAIT_FRACTION", NEVER_ENDING)

    async def run():
        async with make_async() as llm:
            # two requests finish in the same step and nothing else runs: the engine goes idle
            await _within(
                asyncio.gather(_drain(llm, "a", _params(4)), _drain(llm, "b", _params(4))),
                "a request took longer than LIMIT_S",
            )
            assert not llm.engine.step_in_flight()
            # one request where two finished: a wait for two would hold it back
            outs = await _within(_drain(llm, "c", _params(4)), "the idle engine waited for a second request")
            return outs[-1]

    last = asyncio.run(run())
    assert last.finished and len(last.outputs[0].token_ids) == 4


def test_no_wait_in_the_synchronous_loop(make_async, monkeypatch):
    monkeypatch.setattr(async_llm_module, "REFILL_WAIT_FRACTION", NEVER_ENDING)

    async def run():
        async with make_async(async_scheduling=False) as llm:
            steps = _StepsAtDelivery(llm)
            long = asyncio.ensure_future(_drain(llm, "long", _params(24)))
            # "short" and "c" finish together, only "next" follows: a wait for two would never end
            await _within(
                asyncio.gather(_drain(llm, "short", _params(3)), _drain(llm, "c", _params(3))),
                "a request took longer than LIMIT_S",
            )
            assert not llm.engine.step_in_flight()
            await _within(_drain(llm, "next", _params(3)), "the synchronous loop waited for a second request")
            await _within(long, "a request took longer than LIMIT_S")
            return steps

    steps = asyncio.run(run())
    # (a wait for two replacements would have held "next" and "long" past the time limit)
    assert steps.finish["long"] > steps.finish["next"] > steps.first["next"] > steps.finish["short"]

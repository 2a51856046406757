"""`deepinfer generate`: check everything the user gave, load the model, run the requests, and hand
each result out as it finishes (printed, or appended to --output)."""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

from .display import completion_lines
from .errors import FAILED, INTERRUPTED, CliError
from .input_file import InputRequest, read_requests
from .results_file import ResultsFile, check_output_path


def sampling_defaults(args) -> dict:
    """The flags' SamplingParams fields, checked now: a bad flag stops the run before anything loads."""
    from ..sampling_params import SamplingParams

    defaults = dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        n=args.n,
        seq_seed=args.seq_seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
    )
    so_args = structured_output_args(args)
    if so_args is not None:
        defaults["so_args"] = so_args
    try:
        SamplingParams(**defaults)
    except ValueError as e:
        flag = "--" + str(e).split(" ", 1)[0].replace("_", "-")
        raise CliError(f"{flag}: {e}") from None
    return defaults


def structured_output_args(args) -> dict | None:
    """--json-schema / --regex / --grammar as SamplingParams.so_args, validated by deepinfer_structured."""
    if args.json_schema is not None:
        so_args = {"schema_type": "json_schema", "schema": _text_or_file(args.json_schema, "--json-schema")}
        flag = "--json-schema"
    elif args.regex is not None:
        so_args, flag = {"schema_type": "regex", "schema": args.regex}, "--regex"
    elif args.grammar is not None:
        so_args = {"schema_type": "ebnf", "schema": _text_or_file(args.grammar, "--grammar")}
        flag = "--grammar"
    else:
        return None
    from deepinfer_structured import parse_so_args

    try:
        parse_so_args(so_args)
    except ValueError as e:
        raise CliError(f"{flag}: {e}") from None
    return so_args


def _text_or_file(value: str, flag: str) -> str:
    """The flag's text, or the contents of the file it names."""
    stripped = value.strip()
    if stripped.startswith(("{", "[")) or "\n" in value:
        return value
    path = Path(value).expanduser()
    try:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except OSError as e:
        raise CliError(f"{flag} {value}: cannot read it ({e})") from None
    if flag == "--json-schema":
        raise CliError(f"{flag}: {value!r} is neither a file nor JSON schema text")
    return value


def _check_model_path(model: str | None) -> None:
    from ..default_model import checkpoint_dir

    try:
        checkpoint_dir(model)
    except ValueError as e:
        raise CliError(f"--model: {e}") from None


def engine_args_from(args):
    from ..engine_args import EngineArgs

    try:
        return EngineArgs.from_cli_args(args)
    except ValueError as e:
        raise CliError(f"--{str(e).split(' ', 1)[0].replace('_', '-')}: {e}") from None


def cmd_generate(args) -> int:
    # the checks that import nothing first, so that their mistakes are reported at once
    if args.output is not None:
        check_output_path(args.output)
    if args.input is not None and not args.input.is_file():
        raise CliError(f"--input {args.input}: no such file")
    _check_model_path(args.model)
    defaults = sampling_defaults(args)
    engine_args = engine_args_from(args)
    if args.image and args.input is not None:
        raise CliError('--image goes with --prompt; in an --input file give each line its "images"')
    requests = read_requests(args.prompt, args.input, defaults, args.image)
    # in a launched world every rank gets every output and rank 0 alone writes them
    reports = engine_args.launched is None or engine_args.launched.rank == 0
    results = ResultsFile(args.output) if args.output and reports else None
    try:
        return _generate(args, engine_args, requests, results)
    finally:
        if results is not None:
            results.close()


def _generate(args, engine_args, requests: list[InputRequest], results: ResultsFile | None) -> int:
    from ..outputs import RequestMetrics, RequestOutput

    source = args.input
    done = results.done if results is not None else set()
    skipped = [r for r in requests if r.error is None and r.resume_key in done]
    if skipped:
        say(
            f"resuming: {len(skipped)} of {len(requests)} requests already have a result in "
            f"{results.path}; running the other {len(requests) - len(skipped)}"
        )
    todo = [r for r in requests if r not in skipped]
    finished: list = []  # RequestOutputs of this run, for the summary

    def hand_out(req: InputRequest, out) -> None:
        finished.append(out)
        if not reporting:  # a launched world: every rank gets every output, rank 0 reports them
            return
        if out.error is not None:
            print(f"deepinfer generate: error: {req.label(source)}: {out.error}", file=sys.stderr)
        if results is not None:
            record = out.to_json()
            record["index"] = req.index
            if req.has_id:
                record["id"] = req.user_id
            results.write(record)
        elif out.error is None:
            _print_lines(completion_lines(req, out, decode))

    def refused(req: InputRequest, error: str, prompt_ids=None):
        return RequestOutput(
            str(req.index), req.record.get("prompt"), prompt_ids or [], [], RequestMetrics(0.0), error=error
        )

    decode = str  # replaced by the tokenizer's once loaded
    reporting = True
    for req in todo:
        if req.error is not None:
            hand_out(req, refused(req, req.error))
    runnable = [r for r in todo if r.error is None]
    if not runnable:
        return _finish(finished, 0.0, None)

    llm = _load(engine_args)
    engine = llm.engine
    reporting = getattr(engine, "rank", 0) == 0
    decode = _token_decoder(engine)
    by_rid: dict[str, InputRequest] = {}
    for req in runnable:
        try:
            prompt, ids, images = _prompt_of(req, engine)
            if images is None:
                engine.add_request(str(req.index), prompt, req.params, prompt_token_ids=ids)
            else:
                from ..engine.images import check_takes_images  # (torch: not on `--help`'s path)

                check_takes_images(engine)
                mm = {"image": images}
                engine.add_request(
                    str(req.index), prompt, req.params, prompt_token_ids=ids, multi_modal_data=mm
                )
            by_rid[str(req.index)] = req
        except ValueError as e:
            hand_out(req, refused(req, str(e)))
    bar = _progress(args, len(by_rid), disable=not reporting)
    start = time.perf_counter()
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                hand_out(by_rid[out.request_id], out)
                bar.update(1)
    except KeyboardInterrupt:
        bar.close()
        # What finished is already written. An interrupt that lands inside a step can leave that step
        # half-processed, so the engine may refuse the clean-up: the process exits now either way.
        with contextlib.suppress(Exception):
            engine.abort_all()
        with contextlib.suppress(Exception):
            llm.close()
        done = sum(1 for o in finished if o.error is None)
        where = f" in {results.path}; run the same command again to resume" if results else ""
        say(f"interrupted: {done} finished request(s) kept{where}")
        return INTERRUPTED
    bar.close()
    llm.close()
    if not reporting:
        return FAILED if any(o.error is not None for o in finished) else 0
    return _finish(finished, time.perf_counter() - start, engine)


def say(message: str) -> None:
    """A line for the user on stderr, unwrapped (stdout holds the completions)."""
    print(message, file=sys.stderr, flush=True)


def _load(engine_args):
    from ..default_model import RANDOM_WEIGHTS_NOTICE, checkpoint_dir, tiny_model_dir
    from ..llm import LLM

    if checkpoint_dir(engine_args.model) is None and not (tiny_model_dir() / "config.json").exists():
        say(
            f"first use: generating the default model deepinfer-tiny into {tiny_model_dir()} "
            "(once; later runs reuse it)"
        )
    say(f"loading model {engine_args.model or 'deepinfer-tiny'} ...")
    t0 = time.perf_counter()
    llm = LLM(**engine_args.fields())
    if llm.engine.is_default_model:
        say(f"note: {RANDOM_WEIGHTS_NOTICE}")
    say(f"model {llm.engine.model_path} loaded in {time.perf_counter() - t0:.1f}s")
    return llm


def _prompt_of(req: InputRequest, engine) -> tuple[str | None, list[int] | None, list | None]:
    """(prompt text, token ids, images) of a request; ValueError names what is wrong with it. A request
    with images is expanded and checked when it is added."""
    from ..chat_images import image_from_url, split_image_parts

    record = req.record
    if "messages" in record:
        from ..tokenizer import render_chat

        messages, images = split_image_parts(record["messages"])
        prompt = render_chat(messages, engine.tokenizer_config)
        if images:
            return prompt, None, images
        ids = engine.encode(prompt)
    else:
        prompt = record.get("prompt")
        ids = record.get("prompt_token_ids")
        if "images" in record:
            images = [image_from_url(x, f"images[{i}]") for i, x in enumerate(record["images"])]
            return prompt, None if ids is None else list(ids), images
        ids = list(ids) if ids is not None else engine.encode(prompt)
    engine.validate_prompt(ids)
    return prompt, ids, None


def _token_decoder(engine):
    tokenizer = engine.tokenizer

    def decode(token_id: int) -> str:
        try:
            return tokenizer.decode([int(token_id)], skip_special_tokens=False)
        except Exception:  # an id outside the tokenizer (a padded vocabulary): show the id
            return f"<{token_id}>"

    return decode


def _progress(args, total: int, disable: bool = False):
    from tqdm import tqdm

    return tqdm(
        total=total, desc="generate", unit="req", disable=disable or args.no_progress, dynamic_ncols=True
    )


def _print_lines(lines: list[str]) -> None:
    from tqdm import tqdm

    tqdm.write("\n".join(lines), file=sys.stdout)  # above the progress bar, not through it
    sys.stdout.flush()


def _finish(outputs: list, elapsed: float, engine) -> int:
    from rich.console import Console

    from ..summary import summary_table

    Console(stderr=True).print(summary_table(outputs, elapsed, engine))
    return FAILED if any(o.error is not None for o in outputs) else 0

"""A chat request's `tools` and `tool_choice`: what the prompt shows, whether the output is read for calls,
and for a forced call the grammar that makes the output one.

`tool_choice` "none" shows the tools but reads no calls (the text is content as written); "auto" (the
default with tools) reads calls when the model writes the call markup (`deepinfer.tool_calls`), else the
text is content; with `parallel_tool_calls: false` the completion stops at the end of its first call. "required" and a named function constrain generation with an EBNF grammar
(structured outputs) whose every sentence is a block of calls of the allowed functions, each with
arguments valid under its parameters' JSON schema, so even an untrained model's output is a call.
In thinking mode the constraint engages after the think-end token, leaving the reasoning free.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import xgrammar as xg
from deepinfer_structured import StructuredOutputError, audit_json_schema

from ..tool_calls import CALL_BEGIN, CALL_END, CALL_SEP, CALLS_BEGIN, CALLS_END
from .errors import bad_request
from .protocol import ChatCompletionRequest

# OpenAI's rule for function names; it also keeps names free of the call markup
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict] | None  # the definitions the prompt shows
    read_calls: bool  # whether the output is parsed for tool calls
    grammar: str | None  # a forced call's EBNF grammar (tool_choice required / named)
    stop: tuple[str, ...] = ()  # stop strings the completion needs besides the request's own

    def so_args(self, thinking: bool, think_end_id: int | None) -> dict | None:
        """The forced call's structured output; in thinking mode it engages after the reasoning."""
        if self.grammar is None:
            return None
        so_args = {"schema_type": "ebnf", "schema": self.grammar}
        if thinking:
            if think_end_id is None:
                raise bad_request(
                    "a forced tool call in thinking mode needs the tokenizer's think-end token", "tool_choice"
                )
            so_args["trigger_token_ids"] = [think_end_id]
        return so_args


def plan_tools(req: ChatCompletionRequest) -> ToolPlan:
    """Checks `tools` / `tool_choice` (400 naming the field) and plans the request's handling."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise bad_request(
                "tool_choice needs tools (a non-empty list of function definitions)", "tool_choice"
            )
        return ToolPlan(None, False, None)
    schemas: dict[str, dict] = {}
    for i, tool in enumerate(req.tools):
        name, where = tool.function.name, f"tools[{i}].function"
        if not _NAME.fullmatch(name):
            raise bad_request(
                f"{where}.name must be 1 to 64 letters, digits, underscores or dashes, got {name!r}",
                f"{where}.name",
            )
        if name in schemas:
            raise bad_request(f"{where}.name: {name!r} is defined twice", f"{where}.name")
        schemas[name] = _checked_parameters(tool.function.parameters, f"{where}.parameters")
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    if choice is None or choice == "auto":
        # At most one call without parallel calls: the completion stops where its first call ends. A stop
        # string rather than a grammar, because the call markers are ordinary text that a model may
        # spell in many token sequences (a token trigger would miss some, and a grammar over the free
        # text before a call would cost a mask every token); the stop acts on the detokenized text,
        # however it was spelled, leaves everything up to the call's end as the model wrote it, composes
        # with the request's own response_format / so_args, and the parser reads the call it ends in
        # (the stop string removed) as complete. The one call left is the whole reply's.
        return ToolPlan(tools, True, None, () if req.parallel_tool_calls is not False else (CALL_END,))
    if choice == "none":
        return ToolPlan(tools, False, None)
    if choice != "required":
        if choice.function.name not in schemas:
            raise bad_request(
                f"tool_choice names function {choice.function.name!r}, which is not among tools "
                f"({sorted(schemas)})",
                "tool_choice",
            )
        schemas = {choice.function.name: schemas[choice.function.name]}
    if req.response_format is not None and req.response_format.type != "text" or req.so_args is not None:
        raise bad_request(
            "a forced tool call (tool_choice required or a named function) cannot be combined with "
            "response_format or so_args",
            "tool_choice",
        )
    return ToolPlan(tools, True, calls_grammar(schemas, req.parallel_tool_calls is not False))


def _checked_parameters(parameters: dict | None, where: str) -> dict:
    if parameters is None:
        return _NO_PARAMETERS
    if parameters.get("type", "object") != "object":
        raise bad_request(f"{where} must be a JSON schema of an object (type 'object')", where)
    try:
        return audit_json_schema(parameters)
    except StructuredOutputError as e:
        raise bad_request(
            f"{where}: {e.reason}" + (f" at {e.location}" if e.location else ""), where
        ) from None


def calls_grammar(schemas: dict[str, dict], parallel: bool) -> str:
    """EBNF text: a block of calls (one, or one or more with `parallel`) of the functions in `schemas`
    (name -> the arguments' JSON schema), arguments written as `json.dumps` writes them."""

    def literal(text: str) -> xg.Grammar:
        return xg.Grammar.from_ebnf(f"root ::= {json.dumps(text)}")

    calls = [
        xg.Grammar.concat(
            literal(f"{CALL_BEGIN}{name}{CALL_SEP}"),
            xg.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True),
            literal(CALL_END),
        )
        for name, schema in schemas.items()
    ]
    call = calls[0] if len(calls) == 1 else xg.Grammar.union(*calls)
    # The call grammar's text has its root rule named `root`; rules of our own around it make the block,
    # and a union of the one grammar renames its rules so that the block's rule is the text's `root`.
    after = f"tool_more ::= {json.dumps(CALLS_END)} | root tool_more" if parallel else ""
    block = f"tool_block ::= {json.dumps(CALLS_BEGIN)} root " + (
        "tool_more" if parallel else json.dumps(CALLS_END)
    )
    text = f"{call}\n{block}\n{after}\n"
    return str(xg.Grammar.union(xg.Grammar.from_ebnf(text, root_rule_name="tool_block")))

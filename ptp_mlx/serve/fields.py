"""The request fields beyond plain sampling: penalties, ``logit_bias``, log-probabilities, tools, structured output,
and the rule that no field which would change the answer is ever dropped silently.

Each check either returns what the decoder needs or raises a 400 naming the field. A lenient server
(``ptp-serve --lenient``) records the field in ``ignored`` instead of refusing it.
"""

from __future__ import annotations

import json
import math
from typing import Any

from ..logits import MAX_TOP_LOGPROBS, LogitsSettings


class Refusals:
    """Collects refusals: raises at once, or (lenient) remembers the field as ignored."""

    def __init__(self, lenient: bool, bad) -> None:
        self.lenient, self.bad, self.ignored = lenient, bad, []

    def refuse(self, name: str, message: str) -> None:
        if self.lenient:
            self.ignored.append(name)
            return
        raise self.bad(f"{message} (ptp-serve --lenient ignores it)", name, "unsupported_parameter")


# Other servers' sampling fields at the value that turns them off: a client sending these defaults asks for nothing.
NEUTRAL = {"min_p": 0, "repetition_penalty": 1, "typical_p": 1, "top_a": 0, "tfs_z": 1, "mirostat": 0, "min_tokens": 0}


def check_names(body: dict, allowed: set[str], no_effect: set[str], r: Refusals) -> None:
    """Every field must be one this server honours, one that changes nothing, or null or a neutral value."""
    for name, v in body.items():
        if name in allowed or name in no_effect or v is None:
            continue
        if name in NEUTRAL and not isinstance(v, bool) and v == NEUTRAL[name]:
            continue
        r.refuse(name, f"'{name}' is not supported by this server")


def _float(body: dict, name: str, bad) -> float:
    v = body.get(name)
    if v is None:
        return 0.0
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad(f"'{name}' must be a number, got {v!r}", name, "invalid_type")
    if not -2.0 <= v <= 2.0:
        raise bad(f"'{name}' must be between -2 and 2, got {v:g}", name)
    return float(v)


def _logit_bias(body: dict, bad) -> dict[int, float]:
    v = body.get("logit_bias")
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise bad("'logit_bias' must be an object mapping token ids to numbers", "logit_bias", "invalid_type")
    out = {}
    for k, b in v.items():
        try:
            t = int(k)
        except ValueError:
            raise bad(f"'logit_bias' keys must be token ids, got {k!r}", "logit_bias", "invalid_type") from None
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) or not -100 <= b <= 100:
            raise bad(f"'logit_bias' values must be numbers in [-100, 100], got {b!r}", "logit_bias")
        out[t] = float(b)
    return out


def logits_settings(body: dict, kind: str, bad) -> LogitsSettings:
    """Penalties, ``logit_bias`` and log-probabilities. Chat: ``logprobs`` (bool) and ``top_logprobs`` (0-20);
    completions: ``logprobs`` (an integer, 0-20: the number of alternatives)."""
    lp = body.get("logprobs")
    top = body.get("top_logprobs")
    logprobs = None
    if kind == "chat":
        if lp is not None and not isinstance(lp, bool):
            raise bad(f"'logprobs' must be a boolean, got {lp!r}", "logprobs", "invalid_type")
        if top is not None:
            if isinstance(top, bool) or not isinstance(top, int):
                raise bad(f"'top_logprobs' must be an integer, got {top!r}", "top_logprobs", "invalid_type")
            if not 0 <= top <= MAX_TOP_LOGPROBS:
                raise bad(f"'top_logprobs' must be between 0 and {MAX_TOP_LOGPROBS}, got {top}", "top_logprobs")
            if not lp:
                raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        if lp:
            logprobs = top or 0
    elif lp is not None:
        if isinstance(lp, bool) or not isinstance(lp, int):
            raise bad(f"'logprobs' must be an integer, got {lp!r}", "logprobs", "invalid_type")
        if not 0 <= lp <= MAX_TOP_LOGPROBS:
            raise bad(f"'logprobs' must be between 0 and {MAX_TOP_LOGPROBS}, got {lp}", "logprobs")
        logprobs = lp
    return LogitsSettings(
        frequency_penalty=_float(body, "frequency_penalty", bad),
        presence_penalty=_float(body, "presence_penalty", bad),
        logit_bias=_logit_bias(body, bad),
        logprobs=logprobs,
    )


def response_grammar(body: dict, bad) -> str | None:
    """``response_format``: the grammar that constrains the answer (None for text). json_object: any JSON object;
    json_schema: JSON text matching the schema (ptp_mlx/constrain.py)."""
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise bad("'response_format' must be an object with a 'type'", "response_format", "invalid_type")
    if rf["type"] == "text":
        return None
    if rf["type"] not in ("json_object", "json_schema"):
        raise bad(f"unknown 'response_format' type {rf['type']!r}", "response_format")
    from ..constrain import json_grammar, schema_of

    try:
        return json_grammar(schema_of(rf))
    except ValueError as e:
        raise bad(f"'response_format' cannot be honoured: {e}", "response_format") from None


def chat_extras(body: dict, r: Refusals, bad) -> list[dict] | None:
    """``tools``, ``tool_choice``, ``parallel_tool_calls``, ``modalities``: the tools to give the chat template
    (None: none), refusing what the server cannot honour."""
    mods = body.get("modalities")
    if mods is not None and mods != ["text"]:
        r.refuse("modalities", "'modalities' other than ['text'] are not supported")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict) for t in tools
        ):
            raise bad("'tools' must be a list of {'type': 'function', 'function': {...}}", "tools", "invalid_type")
        if not all(isinstance(t["function"].get("name"), str) for t in tools):
            raise bad("every tool's function needs a 'name'", "tools", "invalid_value")
        tools = tools or None
    choice = body.get("tool_choice")
    if choice is not None:
        if choice == "none":
            tools = None  # the model is not offered any tool
        elif choice != "auto":
            r.refuse("tool_choice", f"'tool_choice' {json.dumps(choice)} (forcing a call) is not supported")
    if body.get("parallel_tool_calls") is False:
        r.refuse("parallel_tool_calls", "'parallel_tool_calls': false is not supported")
    return tools


def completion_extras(body: dict, r: Refusals) -> None:
    if body.get("echo"):
        r.refuse("echo", "'echo' is not supported")
    if body.get("suffix") not in (None, ""):
        r.refuse("suffix", "'suffix' is not supported")
    if body.get("best_of") not in (None, 1):
        r.refuse("best_of", "only 'best_of' = 1 is supported")


def chat_message(m: dict, i: int, content) -> dict:
    """One message for the chat template: role and content, plus an assistant's ``tool_calls`` (arguments as
    objects, as chat templates expect and mlx-lm passes them) and a tool message's ``tool_call_id`` and ``name``."""
    role = m["role"]
    out: dict[str, Any] = {"role": "system" if role == "developer" else role}
    calls = m.get("tool_calls") if role == "assistant" else None
    out["content"] = "" if m.get("content") is None and (calls or role == "assistant") else content(m.get("content"), i)
    if calls is not None:
        if not isinstance(calls, list):
            raise ValueError(f"messages[{i}].tool_calls")
        conv = []
        for c in calls:
            f = c.get("function") if isinstance(c, dict) else None
            if not isinstance(f, dict) or not isinstance(f.get("name"), str):
                raise ValueError(f"messages[{i}].tool_calls")
            args = f.get("arguments", {})
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except ValueError:
                    raise ValueError(f"messages[{i}].tool_calls") from None
            conv.append({"id": c.get("id"), "type": "function", "function": {"name": f["name"], "arguments": args}})
        out["tool_calls"] = conv
    if role == "tool":
        for k in ("tool_call_id", "name"):
            if isinstance(m.get(k), str):
                out[k] = m[k]
    return out

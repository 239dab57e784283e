"""``Judge``: a reward read from a judge model's reply, over any OpenAI-compatible endpoint.

A rubric template is filled for each completion (``{prompt}``, ``{completion}`` and any data column by name), sent
as a chat request with the ``openai`` SDK's ``AsyncOpenAI`` to ``base_url`` (a local vLLM or llama.cpp server, a
hosted API), and the reply is parsed into a score:

* ``number``: the first number of the reply, which must lie in ``[low, high]``; mapped onto ``[0, 1]`` when
  ``normalize`` (the default, so that a judge adds up with 0/1 rewards), else kept as it is;
* ``yes_no``: 1.0 for a reply whose first yes-or-no word is "yes", 0.0 for "no";
* ``pairwise``: completions are compared two by two (rows ``2k`` and ``2k+1``, which must share their prompt: online
  DPO with ``group_size: 2``); the template has ``{completion_a}`` and ``{completion_b}``, the reply names ``A`` or
  ``B`` (``[[A]]`` is read first), and the preferred completion scores 1.0, the other 0.0. With ``both_orders``
  each pair is asked twice, swapped, and a judge that changes its mind with the order scores both 0.5 (a tie).

A call that times out, fails to connect, or gets HTTP 429 or a 5xx is retried (``retries``, exponential
``backoff``); one that still fails, or whose reply does not parse, scores ``default`` (None: not applicable) and is
counted (``rollout/reward_errors/<name>``). The key is read from the environment variable named by ``api_key_env``.
"""

from __future__ import annotations

import asyncio
import math
import re
import string
from typing import Any, Literal, cast

from align.errors import AlignConfigError
from align.rollout.rewards.service import REWARDS_EXTRA, ServiceReward

JudgeParser = Literal["number", "yes_no", "pairwise"]

TEMPLATES: dict[str, str] = {
    "number": (
        "Rate how well the response answers the prompt, for correctness and helpfulness, on a scale from "
        "{low:g} to {high:g}.\n\nPrompt:\n{{prompt}}\n\nResponse:\n{{completion}}\n\nReply with the score "
        "only."
    ),
    "yes_no": (
        "Does the response answer the prompt correctly?\n\nPrompt:\n{{prompt}}\n\nResponse:\n{{completion}}"
        "\n\nReply with yes or no only."
    ),
    "pairwise": (
        "Which response answers the prompt better?\n\nPrompt:\n{{prompt}}\n\nResponse A:\n{{completion_a}}"
        "\n\nResponse B:\n{{completion_b}}\n\nReply with A or B only."
    ),
}
"""The default rubric of each parser (``{low}``/``{high}`` filled in at construction)."""

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)
_BRACKETED = re.compile(r"\[\[\s*([AB])\s*\]\]")
_LETTER = re.compile(r"\b([AB])\b")


def parse_number(reply: str, low: float, high: float, normalize: bool = True) -> float:
    """The first number of ``reply``, in ``[low, high]``; ``(x - low) / (high - low)`` when ``normalize``.
    Raises ValueError for a reply without a number or with one out of range."""
    match = _NUMBER.search(reply)
    if match is None:
        raise ValueError(f"no number in the judge's reply {reply[:80]!r}")
    value = float(match.group())
    if not low <= value <= high:
        raise ValueError(f"the judge's score {value:g} is outside [{low:g}, {high:g}]")
    return (value - low) / (high - low) if normalize else value


def parse_yes_no(reply: str) -> float:
    """1.0 when the first "yes" or "no" word of ``reply`` is "yes", 0.0 when "no"; ValueError without either."""
    match = _YES_NO.search(reply)
    if match is None:
        raise ValueError(f"neither yes nor no in the judge's reply {reply[:80]!r}")
    return 1.0 if match.group(1).lower() == "yes" else 0.0


def parse_choice(reply: str) -> int:
    """0 when ``reply`` prefers response A, 1 for B: a ``[[A]]``/``[[B]]`` first, else the first standalone capital
    ``A`` or ``B``. Raises ValueError when it names neither."""
    match = _BRACKETED.search(reply) or _LETTER.search(reply)
    if match is None:
        raise ValueError(f"neither A nor B in the judge's reply {reply[:80]!r}")
    return 0 if match.group(1) == "A" else 1


class Judge(ServiceReward):
    """A judge model behind an OpenAI-compatible endpoint as a reward (``fn: align.rewards.Judge`` with
    ``init_kwargs``; docs/rewards.md)."""

    what = "align.rewards.Judge"

    def __init__(
        self,
        model: str,
        base_url: str,
        template: str | None = None,
        parser: JudgeParser = "number",
        low: float = 0.0,
        high: float = 10.0,
        normalize: bool = True,
        both_orders: bool = False,
        system_prompt: str | None = None,
        api_key_env: str | None = None,
        temperature: float = 0.0,
        max_tokens: int | None = 32,
        extra_body: dict | None = None,
        default: float | None = 0.0,
        max_concurrency: int = 16,
        timeout: float = 60.0,
        retries: int = 3,
        backoff: float = 1.0,
        api_key: Any = None,
    ):
        """
        Args:
            model: The judge model's name at the endpoint.
            base_url: The endpoint, e.g. ``http://localhost:8000/v1`` (vLLM) or ``https://api.openai.com/v1``.
            template: The rubric, with ``{prompt}``, ``{completion}`` (pairwise: ``{completion_a}``,
                ``{completion_b}``) and data columns by name; literal braces doubled. None: the parser's default.
            parser: ``number``, ``yes_no`` or ``pairwise`` (module docstring).
            low: The low end of a ``number`` score's range; a reply outside the range is a failed call.
            high: The high end of a ``number`` score's range.
            normalize: Map a ``number`` score from ``[low, high]`` onto ``[0, 1]``; false keeps it as it is.
            both_orders: ``pairwise``: ask each pair in both orders; a judge that disagrees with itself gives a tie.
            system_prompt: A system message before the rubric; None: none.
            api_key_env: The NAME of the environment variable that holds the key; None: no key (a local server).
            temperature: Sampling temperature of the judge's reply.
            max_tokens: The most tokens of the judge's reply; None: not sent.
            extra_body: More fields of the request body (e.g. ``{top_k: 1}``).
            default: The score of a call that failed or a reply that did not parse; None: not applicable.
            max_concurrency: Requests in flight at once.
            timeout: Seconds per request.
            retries: Further tries of a request that timed out, failed to connect or got HTTP 429 or 5xx.
            backoff: Seconds before the first retry, doubled for each next one.
            api_key: Refused: keys come from ``api_key_env``.
        """
        super().__init__(
            api_key_env,
            base_url,
            default,
            max_concurrency,
            timeout,
            retries,
            backoff,
            api_key,
            url_name="base_url",
            model=model,
            system_prompt=system_prompt,
            extra_body=extra_body or {},
        )
        try:
            import openai  # noqa: F401
        except ImportError:
            raise AlignConfigError(f"{self.what} needs the openai package; install it with: {REWARDS_EXTRA}") from None
        if parser not in TEMPLATES:
            raise AlignConfigError(f"{self.where}.parser: expected one of {list(TEMPLATES)}, got {parser!r}")
        if parser == "number" and not math.isfinite(low):
            raise AlignConfigError(f"{self.where}.low: expected a finite number, got {low!r}")
        if parser == "number" and not (math.isfinite(high) and low < high):
            raise AlignConfigError(f"{self.where}.high: expected a finite number above low={low!r}, got {high!r}")
        if max_tokens is not None and (
            isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
        ):
            raise AlignConfigError(f"{self.where}.max_tokens: expected an integer >= 1 or null, got {max_tokens!r}")
        self.model, self.base_url, self.parser = model, base_url, parser
        self.low, self.high, self.normalize, self.both_orders = float(low), float(high), normalize, both_orders
        self.system_prompt, self.temperature, self.max_tokens = system_prompt, temperature, max_tokens
        self.extra_body = dict(extra_body or {})
        self.template = template if template is not None else TEMPLATES[parser].format(low=low, high=high)
        self.fields = _fields(self.template, f"{self.where}.template")
        own = {"completion_a", "completion_b"} if parser == "pairwise" else {"completion"}
        missing = sorted(own - self.fields)
        if missing:
            raise AlignConfigError(
                f"{self.where}.template: expected the field(s) "
                f"{', '.join('{' + m + '}' for m in missing)} of the {parser} parser, got a "
                "template without them"
            )
        self.own_fields = own | {"prompt"}

    def __repr__(self) -> str:
        return f"Judge(model={self.model!r}, base_url={self.base_url!r}, parser={self.parser!r})"

    @property
    def label(self) -> str:
        return f"judge {self.model} at {self.base_url}"

    def check_columns(self, available: list[str]) -> None:
        """Fail before the first rollout when the template names a field that no column or input provides."""
        known = self.own_fields | (set(available) - {"prompts", "completions"})
        unknown = sorted(self.fields - known)
        if unknown:
            raise AlignConfigError(
                f"{self.where}.template: expected fields that are data columns or inputs "
                f"(known: {', '.join(sorted(known))}; write a literal brace as {{{{ or }}}}), got "
                f"{', '.join('{' + u + '}' for u in unknown)}"
            )

    def retryable(self, err: BaseException) -> bool:
        import openai

        if isinstance(err, openai.APIConnectionError):  # a timeout (APITimeoutError) or a failed connection
            return True
        if isinstance(err, openai.APIStatusError):
            return err.status_code == 429 or err.status_code >= 500
        return super().retryable(err)

    def _client(self):
        import openai

        # No key: a placeholder, never the SDK's own OPENAI_API_KEY, which must not reach another server.
        return openai.AsyncOpenAI(
            base_url=self.base_url, api_key=self.api_key() or "none", timeout=self.timeout, max_retries=0
        )

    async def ask(self, content: str) -> str:
        """The judge's reply to one filled-in rubric (retried as the settings say)."""
        client = self.per_loop("client", self._client)
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages.append({"role": "user", "content": content})
        options: dict[str, Any] = {"temperature": self.temperature}
        if self.max_tokens is not None:
            options["max_tokens"] = self.max_tokens
        if self.extra_body:
            options["extra_body"] = self.extra_body
        response = await self.attempt(
            lambda: client.chat.completions.create(model=self.model, messages=messages, **options)
        )
        choices = getattr(response, "choices", None) or []
        text = choices[0].message.content if choices and choices[0].message is not None else None
        if not isinstance(text, str) or not text.strip():
            raise ValueError("the judge's reply is empty")
        return text

    def render(self, fields: dict[str, Any]) -> str:
        try:
            return self.template.format_map(fields)
        except (KeyError, IndexError, ValueError) as err:
            raise AlignConfigError(
                f"{self.what}: cannot fill the template: {type(err).__name__}: {err} (fields: "
                f"{', '.join(sorted(fields))}; write a literal brace as {{{{ or }}}})"
            ) from None

    async def __call__(self, prompts: list[str], completions: list[str], **columns: Any) -> list[float | None]:
        n = len(completions)
        rows = [
            {
                "prompt": prompts[i],
                **{k: (v[i] if isinstance(v, (list, tuple)) and len(v) == n else v) for k, v in columns.items()},
            }
            for i in range(n)
        ]
        failures: list[str] = []
        if self.parser == "pairwise":
            if n % 2 or any(prompts[i] != prompts[i + 1] for i in range(0, n, 2)):
                raise ValueError(
                    "a pairwise judge compares completions two by two, and completions 2k and 2k+1 must "
                    "share their prompt: sample an even number per prompt (online DPO: group_size 2)"
                )
            asks = [
                [
                    self.render({**rows[i], "completion_a": completions[a], "completion_b": completions[b]})
                    for a, b in ([(i, i + 1), (i + 1, i)] if self.both_orders else [(i, i + 1)])
                ]
                for i in range(0, n, 2)
            ]
            pairs = await asyncio.gather(*(self._pair(texts, failures) for texts in asks))
            scores = [s for pair in pairs for s in pair]
            calls = len(asks)
        else:
            texts = [self.render({**rows[i], "completion": completions[i]}) for i in range(n)]
            scores = list(await asyncio.gather(*(self._one(text, failures) for text in texts)))
            calls = n
        self.report(failures, calls)
        return scores

    async def _one(self, text: str, failures: list[str]) -> float | None:
        try:
            reply = await self.ask(text)
            if self.parser == "yes_no":
                return parse_yes_no(reply)
            return parse_number(reply, self.low, self.high, self.normalize)
        except Exception as err:  # noqa: BLE001 - a failed call scores the default and is counted
            return self.failed(1, err, failures)[0]

    async def _pair(self, texts: list[str], failures: list[str]) -> list[float | None]:
        try:
            replies = await asyncio.gather(*(self.ask(t) for t in texts), return_exceptions=True)
            error = next((r for r in replies if isinstance(r, BaseException)), None)
            if error is not None:
                raise error
            choices = [parse_choice(cast(str, reply)) for reply in replies]  # no exception among them: raised above
        except Exception as err:  # noqa: BLE001 - a failed pair scores the default and is counted
            return self.failed(2, err, failures)
        if len(choices) == 2 and choices[0] == choices[1]:  # swapped order, same position: the judge disagrees
            return [0.5, 0.5]
        return [1.0, 0.0] if choices[0] == 0 else [0.0, 1.0]


def _fields(template: str, key: str) -> set[str]:
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as err:
        raise AlignConfigError(
            f"{key}: expected a format string (write a literal brace as {{{{ or }}}}), got one that is not ({err})"
        ) from None
    return {re.split(r"[.\[]", name, maxsplit=1)[0] for _, name, _, _ in parsed if name is not None and name != ""}


__all__ = ["Judge", "JudgeParser", "TEMPLATES", "parse_choice", "parse_number", "parse_yes_no"]

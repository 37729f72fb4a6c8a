"""Rewards: one float per response from a Python function, a local reward model, an HTTP service
(`astrai.rollout.http_reward`), or a weighted sum of several (the `reward:` config section).

Every source is called with keyword arguments, one list entry per response of the rank's rollout:

    prompts       list[str]         the rendered prompt (chat template applied) the policy saw
    responses     list[str]         the sampled response, special tokens removed
    prompt_ids    list[list[int]]   the prompt's token ids (no padding)
    response_ids  list[list[int]]   the response's token ids, up to and including EOS
    messages      list[list[dict]]  the prompt as chat messages [{role, content}]
    rows          list[dict]        the data row the prompt came from, every field of it: this is how
                                    task metadata (an `answer`, test cases) reaches a verifier

A function receives the ones its signature names (all of them if it takes **kwargs) and returns a
sequence of floats of the same length. Whatever goes wrong (it raises, returns the wrong length, a
NaN or an inf) stops the run with a `RewardError` naming the reward, never a silent 0.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from astrai.errors import AstraiError

logger = logging.getLogger("astrai.rewards")

INPUT_NAMES = ("prompts", "responses", "prompt_ids", "response_ids", "messages", "rows")


class RewardError(AstraiError):
    """A reward that cannot be loaded or did not return one finite float per response."""


def reward_inputs(rollout) -> dict[str, list]:
    """The keyword arguments every reward source receives, from a `RolloutResult`."""
    prompt_ids = [ids[keep.bool()].tolist() for ids, keep in zip(rollout.prompt_ids, rollout.prompt_mask)]
    response_ids = [ids[keep.bool()].tolist() for ids, keep in zip(rollout.response_ids, rollout.response_mask)]
    return {
        "prompts": rollout.prompt_texts,
        "responses": rollout.response_texts,
        "prompt_ids": prompt_ids,
        "response_ids": response_ids,
        "messages": rollout.messages,
        "rows": rollout.rows,
    }


def checked_scores(name: str, values, expected: int) -> torch.Tensor:
    """`values` as a float32 tensor [expected], or a RewardError naming the reward and the fault."""
    try:
        scores = (
            torch.as_tensor(values if isinstance(values, torch.Tensor) else list(values), dtype=torch.float64)
            .flatten()
            .cpu()
        )
    except (TypeError, ValueError) as error:
        raise RewardError(
            f"reward {name!r} must return a sequence of floats, got {type(values).__name__}: {error}"
        ) from None
    if scores.numel() != expected:
        raise RewardError(
            f"reward {name!r} returned {scores.numel()} values for {expected} responses (one float per response)"
        )
    bad = (~torch.isfinite(scores)).nonzero().flatten().tolist()
    if bad:
        raise RewardError(
            f"reward {name!r} returned a non-finite value ({scores[bad[0]].item()}) for response {bad[0]} ({len(bad)} "
            "in all)"
        )
    return scores.float()


# ----------------------------------------------------------------------------- sources


class FunctionReward:
    """`function: "package.module:name"`: any importable callable (see the module docstring)."""

    def __init__(self, spec: str, name: str | None = None):
        self.spec = spec
        self.name = name or spec.rpartition(":")[2]
        self.function = load_function(spec)
        parameters = inspect.signature(self.function).parameters.values()
        takes_all = any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters)
        self.wanted = set(INPUT_NAMES) if takes_all else {parameter.name for parameter in parameters} & set(INPUT_NAMES)

    def __call__(self, inputs: dict[str, list]) -> list[float]:
        return self.function(**{key: value for key, value in inputs.items() if key in self.wanted})


def load_function(spec: str) -> Callable:
    module_name, colon, attribute = spec.partition(":")
    if not colon or not module_name or not attribute:
        raise RewardError(f"reward.function: {spec!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise RewardError(f"reward.function: cannot import {module_name!r} for {spec!r}: {error}") from None
    except SyntaxError as error:  # the module's own code: name its file and line
        where = f"{error.filename}:{error.lineno}"
        raise RewardError(f"reward.function: {where}: {error.msg} (importing {module_name!r} for {spec!r})") from None
    except Exception as error:  # the module runs code at import; whatever it raises means it cannot be used
        raised = f"{type(error).__name__}: {error}"
        raise RewardError(f"reward.function: importing {module_name!r} for {spec!r} raised {raised}") from None
    except SystemExit as error:  # sys.exit() at import: uncaught, it ends the run printing only its own words
        raise RewardError(
            f"reward.function: {_import_site(error, module_name)}: the module exited while being imported, with "
            f"{_exit_described(error)} (importing {module_name!r} for {spec!r}); a reward module must not exit"
        ) from None
    function = getattr(module, attribute, None)
    if not callable(function):
        raise RewardError(f"reward.function: {module_name!r} has no callable {attribute!r}")
    return function


def _import_site(error: BaseException, module_name: str) -> str:
    """'file:line' of the first module-level code in `error`'s traceback: the line of the imported module
    (or of a parent package) where the import went wrong; the module's name where there is none."""
    sites = [
        f"{frame.f_code.co_filename}:{line}"
        for frame, line in traceback.walk_tb(error.__traceback__)
        if frame.f_code.co_name == "<module>"
    ]
    return sites[0] if sites else f"module {module_name!r}"


def _exit_described(error: SystemExit) -> str:
    """SystemExit's code as the call that raised it would read: 'sys.exit(3)', "sys.exit('no GPU')", 'sys.exit()'."""
    code = "" if error.code is None else repr(error.code)
    return f"sys.exit({code if len(code) <= 200 else code[:197] + '...'})"


class ModelReward:
    """`model_path`: a local AutoModelForSequenceClassification with one output, scoring the prompt's
    chat plus the response (rendered with the reward model's own chat template when it has one).
    A full copy is loaded on every rank, in fp32, and only evaluated."""

    def __init__(
        self, path: str, device: torch.device, batch_size: int, name: str | None = None, normalize: str = "none"
    ):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.name = name or Path(path).name
        if not Path(path).is_dir():
            raise RewardError(f"reward.model_path: local folder {path!r} does not exist")
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            self.model = AutoModelForSequenceClassification.from_pretrained(
                path, local_files_only=True, dtype=torch.float32
            )
        except (OSError, ValueError) as error:
            raise RewardError(f"reward.model_path: cannot load {path!r} as a sequence classifier: {error}") from None
        if self.model.config.num_labels != 1:
            raise RewardError(
                f"reward.model_path: {path!r} has num_labels {self.model.config.num_labels} (config.json); a reward "
                "model has one output, num_labels 1"
            )
        self.mean, self.std = 0.0, 1.0
        if normalize == "stored":  # the mean and std an rm export measured over its training pairs
            from astrai.models.reward import read_reward_stats

            try:
                self.mean, self.std = read_reward_stats(path)
            except ValueError as error:
                raise RewardError(f"reward.normalize stored: {error}") from None
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if self.model.config.pad_token_id is None:  # the classifier finds each row's last token by it
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.tokenizer.padding_side = "right"
        self.model.to(device).eval().requires_grad_(False)
        self.device, self.batch_size = device, batch_size

    def texts(self, inputs: dict[str, list]) -> list[str]:
        if self.tokenizer.chat_template:
            return [
                self.tokenizer.apply_chat_template(chat + [{"role": "assistant", "content": response}], tokenize=False)
                for chat, response in zip(inputs["messages"], inputs["responses"])
            ]
        return [prompt + response for prompt, response in zip(inputs["prompts"], inputs["responses"])]

    @torch.no_grad()
    def __call__(self, inputs: dict[str, list]) -> torch.Tensor:
        texts, scores = self.texts(inputs), []
        limit = getattr(self.model.config, "max_position_embeddings", None)
        for start in range(0, len(texts), self.batch_size):
            encoded = self.tokenizer(
                texts[start : start + self.batch_size],
                return_tensors="pt",
                padding=True,
                truncation=limit is not None,
                max_length=limit,
                add_special_tokens=not self.tokenizer.chat_template,
            ).to(self.device)
            scores.append(self.model(**encoded).logits[:, 0].float().cpu())
        return (torch.cat(scores) - self.mean) / self.std


# ----------------------------------------------------------------------------- combination


@dataclass
class RewardScores:
    total: torch.Tensor  # [N] float32, sum of weight x component
    components: dict[str, torch.Tensor]  # name -> [N] float32, unweighted; empty for a single source


class WeightedReward:
    """sum_k weight_k * reward_k(responses), each reward checked on its own (so errors name it)."""

    def __init__(self, sources: Sequence[tuple[object, float]]):
        names = [source.name for source, _ in sources]
        if len(set(names)) != len(names):
            raise RewardError(f"reward.components: names must differ (got {names}); set `name:` on each")
        self.sources = list(sources)

    @property
    def names(self) -> list[str]:
        return [source.name for source, _ in self.sources]

    def __call__(self, inputs: dict[str, list]) -> RewardScores:
        expected = len(inputs["responses"])
        total, components = torch.zeros(expected), {}
        for source, weight in self.sources:
            try:
                values = source(inputs)
            except RewardError:
                raise
            except Exception as error:  # a user's function may raise anything: name it and keep the cause
                raise RewardError(f"reward {source.name!r} raised {type(error).__name__}: {error}") from error
            except SystemExit as error:  # sys.exit() in a user's function would end this rank alone, unnamed
                raise RewardError(f"reward {source.name!r} exited with {_exit_described(error)}") from error
            scores = checked_scores(source.name, values, expected)
            components[source.name] = scores
            total += weight * scores
        return RewardScores(total, components if len(self.sources) > 1 else {})


def build_source(config, device: torch.device):
    if config.function is not None:
        return FunctionReward(config.function, config.name)
    if config.model_path is not None:
        return ModelReward(config.model_path, device, config.batch_size, config.name, config.normalize)
    from astrai.rollout.http_reward import HttpReward  # it imports RewardError from here

    return HttpReward(
        config.url, config.timeout_s, config.retries, config.retry_backoff_s, config.name, config.max_response_bytes
    )


def build_reward(config, device: torch.device) -> WeightedReward:
    """The `reward:` section -> a callable inputs -> RewardScores. Loads functions and models now, so
    a wrong name fails before the first rollout."""
    if config is None:
        raise RewardError("online train types need a `reward:` section (function, model_path, url or components)")
    components = config.components or [config]
    return WeightedReward([(build_source(component, device), component.weight) for component in components])


# ----------------------------------------------------------------------------- built-in verifiers


def arithmetic_exact_match(responses: list[str], rows: list[dict]) -> list[float]:
    """The shipped arithmetic task (`data/arithmetic/prompts.jsonl`: {"prompt": "12+7=", "answer": "19"}):
    1.0 when the response, stripped of surrounding whitespace, is exactly the row's `answer`, else 0.0.

    Whole-response match on purpose: a response listing several numbers scores 0, so the policy cannot
    collect reward by hedging. A row without `answer` is an error, not a 0.
    """
    scores = []
    for position, (response, row) in enumerate(zip(responses, rows)):
        if "answer" not in row:
            raise KeyError(f"data row of response {position} has no 'answer' field (fields: {sorted(row)})")
        scores.append(float(response.strip() == str(row["answer"]).strip()))
    return scores


# math-verify's own timeouts use signal.alarm, which works only in the main thread (elsewhere it raises): there
# each parse and each comparison is bounded by this many seconds (a timeout scores 0); in other threads they run
# unbounded.
MATH_VERIFY_TIMEOUT_S = 5
_MATH_DELIMITERS = ("$", "\\boxed", "\\(", "\\[")
_unparsable_gold_logged = False


def math_verify(responses: list[str], rows: list[dict]) -> list[float]:
    """1.0 when the response's final answer is mathematically equal to the row's `answer`, else 0.0, through the
    `math-verify` library (as TRL's accuracy_reward and verl's math_verify use it): 1/2, \\frac{1}{2} and 0.5,
    2\\sqrt{2} and \\sqrt{8}, 50\\% and 0.5 are equal; numbers to 6 decimal places.

    The response's final answer is its last \\boxed{...}; else the last LaTeX or number after "final answer is" or
    "answer"; else its last LaTeX ($...$, \\(...\\), \\[...\\]) or number. Several boxed answers form a set, so
    hedging earns nothing. `answer` is LaTeX without delimiters ("\\frac{1}{2}", "x=2", "0.5") or text holding it
    in $...$ or \\boxed{} (a whole worked solution). An `answer` that does not parse scores 0 for every response
    (logged once, naming the row); a row without `answer` is an error, as in arithmetic_exact_match.
    """
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    timeout = MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    response_targets = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    golds: dict[str, list] = {}  # a GRPO group shares its row: parse each answer once
    scores = []
    for position, (response, row) in enumerate(zip(responses, rows)):
        if "answer" not in row:
            raise KeyError(f"data row of response {position} has no 'answer' field (fields: {sorted(row)})")
        answer = "" if row["answer"] is None else str(row["answer"]).strip()
        if answer not in golds:
            if any(delimiter in answer for delimiter in _MATH_DELIMITERS):
                text, targets = answer, [LatexExtractionConfig(), ExprExtractionConfig()]
            else:  # bare "2\\pi" or "(1, 2)": boxed, so that it is read whole as LaTeX, not as its last number
                text, targets = f"\\boxed{{{answer}}}", [LatexExtractionConfig()]
            golds[answer] = parse(
                text, targets, fallback_mode="no_fallback", extraction_mode="first_match", parsing_timeout=timeout
            )
            if not golds[answer]:
                _log_unparsable_gold(position, row)
        if not golds[answer]:
            scores.append(0.0)
            continue
        parsed = parse(
            response,
            response_targets,
            fallback_mode="no_fallback",
            extraction_mode="first_match",
            parsing_timeout=timeout,
        )
        scores.append(float(bool(parsed) and verify(golds[answer], parsed, timeout_seconds=timeout)))
    return scores


def _log_unparsable_gold(position: int, row: dict) -> None:
    global _unparsable_gold_logged
    if not _unparsable_gold_logged:
        _unparsable_gold_logged = True
        shown = repr(row) if len(repr(row)) <= 300 else repr(row)[:297] + "..."
        logger.warning(
            "math_verify: the 'answer' %r of the data row of response %d does not parse as math, so its responses "
            "score 0 (logged once; later rows like it score 0 too): %s",
            row["answer"],
            position,
            shown,
        )

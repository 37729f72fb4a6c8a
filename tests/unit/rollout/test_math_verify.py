"""astrai.rollout.rewards:math_verify: a table of answers math-verify finds equal and unequal to the row's `answer`,
responses without an answer, rows without or with an unparsable `answer`, its timeouts in the main thread, and
calls from a worker thread (where math-verify's signal-based timeouts cannot run)."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import math_verify as math_verify_library
import pytest
from math_verify import grader, parser

from astrai.rollout import rewards
from astrai.rollout.rewards import FunctionReward, WeightedReward, math_verify

# (response, the row's answer): every behaviour below was checked against math-verify 0.9.0
EQUAL = [
    (r"\boxed{\frac{1}{2}}", "0.5"),
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}"),
    (r"The answer is $\boxed{3}$.", "3"),
    ("x=2", "2"),  # the number after "=" is the answer
    ("$x=2$", "2"),  # an assignment to a variable compares by its value
    (r"\boxed{x=2}", "x=2"),
    ("0.5", r"\frac{1}{2}"),  # a plain number, a LaTeX fraction without $...$
    ("1/2", r"\frac{1}{2}"),
    (r"\[ \frac{1}{2} \]", "0.5"),
    (r"\boxed{\dfrac{3}{4}}", "0.75"),
    (r"\boxed{0.333333}", r"\frac13"),  # numbers compare to 6 decimal places
    (r"\boxed{50\%}", "0.5"),
    ("The answer is 1,000.", "1000"),
    (r"\boxed{10}", "10.0"),
    (r"\boxed{(x+1)^2}", "x^2+2x+1"),
    (r"\boxed{\frac{1}{\sqrt{2}}}", r"\frac{\sqrt{2}}{2}"),
    (r"\boxed{\{1,2\}}", r"\{2,1\}"),
    (r"\boxed{(1,2)}", "(1, 2)"),
    (r"\boxed{2\pi}", r"2\pi"),
    (r"\boxed{\infty}", r"\infty"),
    (r"\boxed{90^\circ}", "90"),
    (r"\boxed{5\text{ cm}}", "5"),
    (r"First 2+2=4, then \boxed{5}", "5"),  # the boxed answer wins over numbers before it
    ("Answer: 7", 7),  # a non-string answer
    ("19", "19"),  # the shipped arithmetic task's bare answers
    (r"\boxed{2}", "$2$"),  # an answer given in $...$
    (r"\boxed{2}", r"Solution: 1+1, so the answer is \boxed{2}."),  # a worked solution as the answer
]
UNEQUAL = [
    (r"\boxed{0.33}", r"\frac{1}{3}"),
    (r"\boxed{0.50001}", "0.5"),
    (r"\boxed{3}", "-3"),
    (r"\boxed{\pi}", "3.14159"),  # pi is 3.141593 to 6 places
    (r"\boxed{2}", r"2\pi"),  # a bare answer is read whole, not as its last number
    (r"\boxed{3}", r"3\sqrt{2}"),
    (r"First 2+2=4, then \boxed{5}", "4"),
    (r"\boxed{4} or \boxed{5}", "5"),  # several answers form a set: hedging earns nothing
    ("$1$, $2$ and $3$", "3"),
    ("19 or 20", "19"),  # the last number is the answer
    ("The answer is 8, not 7", "7"),
    (r"\boxed{x}", "y"),
    (r"\boxed{Tuesday}", r"\text{Monday}"),
    (r"\boxed{[1,2]}", "(1,2)"),  # closed vs open interval
    (r"\boxed{x>2}", r"(2,\infty)"),  # a relation is not compared with an interval
    (r"\boxed{1e3}", "1000"),  # LaTeX reads e as Euler's number: 1e3 is 3e
    (r"\boxed{\frac{1}{2}", "0.5"),  # an unclosed box is no answer
]
NO_ANSWER = ["", "   ", "I am not sure how to solve this.", "Let me think step by step.", r"\boxed{}"]


@pytest.fixture(autouse=True)
def log_again(monkeypatch):
    monkeypatch.setattr(rewards, "_unparsable_gold_logged", False)


def scores(pairs):
    return math_verify([response for response, _ in pairs], [{"answer": answer} for _, answer in pairs])


@pytest.mark.parametrize(("response", "answer"), EQUAL)
def test_equal_answers_score_one(response, answer):
    assert math_verify([response], [{"prompt": "p", "answer": answer}]) == [1.0]


@pytest.mark.parametrize(("response", "answer"), UNEQUAL)
def test_unequal_answers_score_zero(response, answer):
    assert math_verify([response], [{"prompt": "p", "answer": answer}]) == [0.0]


@pytest.mark.parametrize("response", NO_ANSWER)
def test_a_response_without_an_answer_scores_zero(response):
    assert math_verify([response], [{"answer": "3"}]) == [0.0]


def test_a_batch_keeps_its_order_through_the_reward_section():
    pairs = EQUAL[:4] + UNEQUAL[:4] + [("", "3")]
    inputs = {"responses": [r for r, _ in pairs], "rows": [{"answer": a} for _, a in pairs], "prompts": [""] * 9}
    total = WeightedReward([(FunctionReward("astrai.rollout.rewards:math_verify"), 1.0)])(inputs).total
    assert total.tolist() == [1.0] * 4 + [0.0] * 5


def test_a_row_without_an_answer_is_an_error_like_arithmetic_exact_match():
    with pytest.raises(KeyError, match=r"data row of response 1 has no 'answer' field \(fields: \['prompt'\]\)"):
        math_verify(["3", "3"], [{"answer": "3"}, {"prompt": "1+2="}])


def test_an_unparsable_answer_scores_zero_for_every_response_and_is_logged_once(caplog):
    bad = {"prompt": "what is it?", "answer": "\\frac{"}
    with caplog.at_level(logging.WARNING, logger="astrai.rewards"):
        assert math_verify(["\\frac{", r"\boxed{1}", "3"], [bad, bad, {"answer": "3"}]) == [0.0, 0.0, 1.0]
        assert math_verify(["x", "y"], [{"answer": ""}, {"answer": None}]) == [0.0, 0.0]
    logged = [record.getMessage() for record in caplog.records if record.name == "astrai.rewards"]
    assert len(logged) == 1
    assert "'answer' '\\\\frac{' of the data row of response 0 does not parse" in logged[0]
    assert "'prompt': 'what is it?'" in logged[0]


def test_main_thread_calls_are_bounded_by_math_verifys_timeouts(monkeypatch, caplog):
    """A comparison or a parse past MATH_VERIFY_TIMEOUT_S scores 0 (math-verify's SIGALRM fires), never hangs."""
    monkeypatch.setattr(rewards, "MATH_VERIFY_TIMEOUT_S", 1)
    monkeypatch.setattr(grader, "sympy_expr_eq", lambda *args: time.sleep(10) or True)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="math_verify"):
        assert math_verify([r"\boxed{3}"], [{"answer": "3"}]) == [0.0]
    monkeypatch.setattr(parser, "extract_target_from_pred", lambda *args, **kwargs: time.sleep(10) or [3])
    assert math_verify([r"\boxed{3}"], [{"answer": "3"}]) == [0.0]
    assert time.monotonic() - started < 5
    assert any("Timeout during comparison" in record.getMessage() for record in caplog.records)


def test_calls_from_worker_threads_run_without_signal_timeouts(monkeypatch):
    """signal.alarm works only in the main thread: math-verify would raise from any other, so there the timeouts
    are off (None) and the scores are the main thread's."""
    pairs = EQUAL + UNEQUAL + [(response, "3") for response in NO_ANSWER]
    expected = [1.0] * len(EQUAL) + [0.0] * (len(UNEQUAL) + len(NO_ANSWER))
    assert scores(pairs) == expected
    seen, real_parse = [], math_verify_library.parse

    def recording_parse(*args, **kwargs):
        seen.append((threading.current_thread() is threading.main_thread(), kwargs["parsing_timeout"]))
        return real_parse(*args, **kwargs)

    monkeypatch.setattr(math_verify_library, "parse", recording_parse)
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(scores, [pairs, pairs[::-1]]))
    assert results == [expected, expected[::-1]]
    worker = threading.Thread(target=lambda: results.append(scores(pairs)))
    worker.start()
    worker.join()
    assert results[-1] == expected
    math_verify([r"\boxed{1}"], [{"answer": "1"}])
    assert {timeout for main, timeout in seen if not main} == {None}
    assert {timeout for main, timeout in seen if main} == {rewards.MATH_VERIFY_TIMEOUT_S}

"""Rewards: the arithmetic verifier, function loading and argument passing, every error naming its reward,
weighted components, a real HTTP service on loopback (built from the YAML section; retries, a down server,
answers of the wrong length, NaN, non-JSON; the client's hard limits against a dripping server, a huge
answer, a redirect, a non-HTTP address), a local reward model."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import sys
import threading
import time
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from astrai.config.loader import parse_yaml
from astrai.config.schema import RewardConfig
from astrai.rollout.rewards import (
    FunctionReward,
    HttpReward,
    RewardError,
    WeightedReward,
    arithmetic_exact_match,
    build_reward,
    checked_scores,
)

INPUTS = {
    "prompts": ["<p>1+2=", "<p>3+4="],
    "responses": ["3", " 8 "],
    "prompt_ids": [[1, 2], [3, 4]],
    "response_ids": [[5, 9], [6, 9]],
    "messages": [[{"role": "user", "content": "1+2="}]] * 2,
    "rows": [{"prompt": "1+2=", "answer": "3"}, {"prompt": "3+4=", "answer": "7"}],
}
DEVICE = torch.device("cpu")


@pytest.fixture
def user_module():
    """A throwaway importable module `reward_fixtures` holding reward functions good and bad."""
    module = types.ModuleType("reward_fixtures")
    module.lengths = lambda responses: [float(len(r)) for r in responses]
    module.everything = lambda **inputs: [float(sorted(inputs) == sorted(INPUTS))] * len(inputs["responses"])
    module.constant = lambda responses, **_: [0.5] * len(responses)

    def explodes(responses):
        raise ZeroDivisionError("division by zero in the user's code")

    module.explodes = explodes
    module.too_few = lambda responses: [1.0]
    module.nan = lambda responses: [0.0, float("nan")]
    module.inf = lambda responses: [float("inf"), 0.0]
    module.words = lambda responses: ["high", "low"]
    module.not_callable = 3
    sys.modules["reward_fixtures"] = module
    yield module
    del sys.modules["reward_fixtures"]


def combined(*specs, weights=None):
    weights = weights or [1.0] * len(specs)
    return WeightedReward([(FunctionReward(spec), weight) for spec, weight in zip(specs, weights)])


def test_arithmetic_exact_match_reads_the_answer_from_the_row():
    rows = [{"answer": "19"}, {"answer": "19"}, {"answer": "19"}, {"answer": "-4"}, {"answer": 7}]
    assert arithmetic_exact_match(["19", " 19\n", "19 or 20", "-4", "7"], rows) == [1.0, 1.0, 0.0, 1.0, 1.0]
    assert arithmetic_exact_match(["1", "91"], [{"answer": "19"}] * 2) == [0.0, 0.0]
    with pytest.raises(KeyError, match="no 'answer' field"):
        arithmetic_exact_match(["3"], [{"prompt": "1+2="}])


def test_functions_get_the_arguments_they_name(user_module):
    assert combined("reward_fixtures:lengths")(INPUTS).total.tolist() == [1.0, 3.0]
    assert combined("reward_fixtures:everything")(INPUTS).total.tolist() == [1.0, 1.0]  # **kwargs: all six
    scores = combined("astrai.rollout.rewards:arithmetic_exact_match")(INPUTS)
    assert scores.total.tolist() == [1.0, 0.0] and scores.components == {}


def test_weighted_components_and_their_names(user_module):
    scores = combined("reward_fixtures:lengths", "reward_fixtures:constant", weights=[2.0, -1.0])(INPUTS)
    assert scores.total.tolist() == [2 * 1.0 - 0.5, 2 * 3.0 - 0.5]
    assert scores.components["lengths"].tolist() == [1.0, 3.0] and scores.components["constant"].tolist() == [0.5, 0.5]
    with pytest.raises(RewardError, match="names must differ"):
        combined("reward_fixtures:constant", "reward_fixtures:constant")
    config = RewardConfig(
        components=[
            {"function": "reward_fixtures:lengths", "weight": 0.5},
            {"function": "reward_fixtures:lengths", "name": "again"},
        ]
    )
    reward = build_reward(config, DEVICE)
    assert reward.names == ["lengths", "again"] and reward(INPUTS).total.tolist() == [1.5, 4.5]


@pytest.mark.parametrize(
    ("function", "message"),
    [
        ("explodes", "reward 'explodes' raised ZeroDivisionError: division by zero in the user's code"),
        ("too_few", "reward 'too_few' returned 1 values for 2 responses"),
        ("nan", r"reward 'nan' returned a non-finite value \(nan\) for response 1"),
        ("inf", r"reward 'inf' returned a non-finite value \(inf\) for response 0"),
        ("words", "reward 'words' must return a sequence of floats"),
    ],
)
def test_a_broken_reward_function_is_named(user_module, function, message):
    reward = combined("reward_fixtures:constant", f"reward_fixtures:{function}")
    with pytest.raises(RewardError, match=message) as caught:
        reward(INPUTS)
    if function == "explodes":
        assert isinstance(caught.value.__cause__, ZeroDivisionError)  # the user's traceback is kept


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_colon_here", "must look like 'package.module:function'"),
        ("surely_not_a_module_xyz:f", "cannot import 'surely_not_a_module_xyz'"),
        ("reward_fixtures:missing", "has no callable 'missing'"),
        ("reward_fixtures:not_callable", "has no callable 'not_callable'"),
    ],
)
def test_unloadable_functions_fail_at_build_time(user_module, spec, message):
    with pytest.raises(RewardError, match=message):
        FunctionReward(spec)


def test_checked_scores_accepts_tensors_and_arrays():
    assert checked_scores("r", torch.tensor([[1.0], [2.0]]), 2).tolist() == [1.0, 2.0]
    assert checked_scores("r", (0, 1), 2).dtype == torch.float32


# ----------------------------------------------------------------------------- HTTP on loopback


class RewardService(BaseHTTPRequestHandler):
    """Scores each response by its length; `plan` (class attribute) scripts failures first."""

    plan: list = []
    requests: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append(body)
        step = type(self).plan.pop(0) if type(self).plan else "ok"
        if step == "slow":
            time.sleep(0.5)
        if isinstance(step, int):
            self.send_response(step)
            self.end_headers()
            self.wfile.write(b"scripted failure")
            return
        lengths = [float(len(r)) for r in body["responses"]]
        answers = {
            "bare": [1.0, 2.0],
            "short": {"rewards": lengths[:-1]},
            "nan": {"rewards": [1.0, float("nan")]},
            "no_key": {"scores": lengths},
        }
        if step == "html":
            payload = b"<html><body>502 Bad Gateway (from a proxy, with status 200)</body></html>"
        else:
            payload = json.dumps(
                answers.get(step, {"rewards": lengths})
            ).encode()  # json writes NaN as the bare token NaN
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def service():
    RewardService.plan, RewardService.requests = [], []
    server = ThreadingHTTPServer(("127.0.0.1", 0), RewardService)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/score"
    server.shutdown()
    server.server_close()


def http(url, retries=2, timeout_s=5.0):
    return WeightedReward([(HttpReward(url, timeout_s, retries, backoff_s=0.01), 1.0)])


def test_http_reward_sends_every_input_and_reads_rewards(service):
    assert http(service)(INPUTS).total.tolist() == [1.0, 3.0]
    assert sorted(RewardService.requests[0]) == sorted(INPUTS) and RewardService.requests[0]["rows"][1]["answer"] == "7"
    RewardService.plan = ["bare"]
    assert http(service)(INPUTS).total.tolist() == [1.0, 2.0]


def test_http_reward_retries_transient_failures(service):
    RewardService.plan = [503, "slow"]
    assert http(service, retries=2, timeout_s=0.2)(INPUTS).total.tolist() == [1.0, 3.0]  # 503, timeout, then ok
    assert len(RewardService.requests) == 3


def test_http_reward_does_not_retry_a_client_error(service):
    RewardService.plan = [400]
    with pytest.raises(RewardError, match="answered HTTP 400: scripted failure"):
        http(service)(INPUTS)
    assert len(RewardService.requests) == 1


def test_http_reward_gives_up_after_bounded_retries(service):
    RewardService.plan = [503, 503, 503, 503]
    with pytest.raises(RewardError, match=r"no answer after 3 attempts .*last error: HTTP 503"):
        http(service, retries=2)(INPUTS)
    assert len(RewardService.requests) == 3


def test_http_reward_down_server_is_a_clear_error():
    with ThreadingHTTPServer(("127.0.0.1", 0), RewardService) as probe:
        port = probe.server_address[1]  # a port nobody listens on once closed
    started = time.monotonic()
    with pytest.raises(
        RewardError, match=r"no answer after 2 attempts .*refused.*is the reward service running"
    ) as caught:
        http(f"http://127.0.0.1:{port}/score", retries=1)(INPUTS)
    assert f"127.0.0.1:{port}" in str(caught.value) and time.monotonic() - started < 5


def http_from_yaml(url, **settings):
    """The HTTP reward as a job builds it: the `reward:` section of a YAML file -> RewardConfig -> build_reward."""
    lines = "".join(f"  {key}: {value}\n" for key, value in {"url": url, "name": "scorer", **settings}.items())
    return build_reward(RewardConfig.model_validate(parse_yaml(f"reward:\n{lines}")["reward"]), DEVICE)


def test_http_reward_built_from_the_yaml_section_honours_its_settings(service):
    reward = http_from_yaml(service, timeout_s=0.2, retries=1, retry_backoff_s=0.01, weight=2.0)
    source = reward.sources[0][0]
    assert isinstance(source, HttpReward) and (source.url, source.timeout_s, source.retries, source.backoff_s) == (
        service,
        0.2,
        1,
        0.01,
    )
    assert reward.names == ["scorer"] and reward(INPUTS).total.tolist() == [2.0, 6.0]  # weight 2 x the lengths 1, 3
    RewardService.plan = ["slow", "slow"]  # 0.5 s each: longer than timeout_s 0.2, twice
    started = time.monotonic()
    with pytest.raises(RewardError, match=r"reward 'scorer': no answer after 2 attempts"):
        reward(INPUTS)
    assert time.monotonic() - started < 1.0  # timeout_s bounded each attempt (not the 30 s default)


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        ("short", r"reward 'scorer' returned 1 values for 2 responses \(one float per response\)"),
        ("nan", r"reward 'scorer' returned a non-finite value \(nan\) for response 1"),
        (
            "html",
            r"reward 'scorer': the answer is not JSON with a 'rewards' list \(JSONDecodeError.*it began "
            r"b'<html><body>502 Bad Gateway",
        ),
        ("no_key", r"reward 'scorer': the answer is not JSON with a 'rewards' list \(KeyError: 'rewards'\)"),
    ],
)
def test_http_reward_bad_answers_are_clear_errors_naming_the_reward(service, answer, message):
    RewardService.plan = [answer]
    with pytest.raises(RewardError, match=message):
        http_from_yaml(service, retries=2, retry_backoff_s=0.01)(INPUTS)
    assert len(RewardService.requests) == 1  # an answer that is not rewards is not retried


# ----------------------------------------------------------------------------- reward model


def test_local_reward_model_scores_each_response_alone(tmp_path):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from tests.unit.rollout_fixtures import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    LlamaForSequenceClassification(config).save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    reward = build_reward(RewardConfig(model_path=str(tmp_path / "rm"), batch_size=2), DEVICE)
    inputs = dict(
        INPUTS, responses=["3", "a much longer reply", "7"], messages=[INPUTS["messages"][0]] * 3, prompts=["p"] * 3
    )
    batched = reward(inputs).total
    alone = [
        reward({**inputs, "responses": [text], "messages": inputs["messages"][:1]}).total.item()
        for text in inputs["responses"]
    ]
    assert batched.shape == (3,) and torch.isfinite(batched).all()
    assert batched.tolist() == pytest.approx(alone, abs=1e-5)  # padding in a batch does not change a score
    with pytest.raises(RewardError, match="does not exist"):
        build_reward(RewardConfig(model_path=str(tmp_path / "nowhere")), DEVICE)


def test_reward_config_takes_exactly_one_source():
    with pytest.raises(ValueError, match="exactly one of `reward.function`"):
        RewardConfig(function="a:b", url="http://x")
    with pytest.raises(ValueError, match="exactly one of `function`, `model_path` or `url`"):
        RewardConfig(components=[{"weight": 2.0}])


# ----------------------------------------------------------------------------- hard limits of the HTTP client


def serve_raw(handle):
    """A TCP server on 127.0.0.1 whose every connection runs `handle(connection)` in its own thread; yields its port."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def accept():
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=handle, args=(connection, stop), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return listener, stop


@contextlib.contextmanager
def raw_service(handle):
    listener, stop = serve_raw(handle)
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/score"
    finally:
        stop.set()
        listener.close()


def read_request(connection) -> None:
    """Read one request's head and body (Content-Length) so that the client's send completes."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += connection.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    length = int(next(line.split(b":")[1] for line in lines if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += connection.recv(65536)


def call_bounded(reward, bound_s=30.0):
    """Call `reward(INPUTS)` in a thread; the error it raised, or a failure if it is still running after bound_s."""
    outcome = {}

    def target():
        try:
            outcome["value"] = reward(INPUTS)
        except Exception as error:  # noqa: BLE001 - the test inspects it
            outcome["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(bound_s)
    assert not thread.is_alive(), f"the reward call still runs after {bound_s} s"
    return outcome.get("error")


def drip(connection, stop):
    """A status line, then one header byte every 0.2 s for as long as the client listens."""
    with connection:
        read_request(connection)
        connection.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
        while not stop.is_set():
            time.sleep(0.2)
            try:
                connection.sendall(b"a")
            except OSError:
                return


def test_http_reward_timeout_bounds_the_whole_request_against_a_dripping_server():
    with raw_service(drip) as url:
        error = call_bounded(http_from_yaml(url, timeout_s=1, retries=1, retry_backoff_s=0.01))
    assert isinstance(error, RewardError), error
    expected = r"no answer after 2 attempts .*last error: no complete answer within timeout_s 1 s"
    assert re.search(expected, str(error)), error


def endless_body(declare_length):
    def handle(connection, stop):
        with connection:
            read_request(connection)
            head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            head += b"Content-Length: 100000000\r\n\r\n" if declare_length else b"Connection: close\r\n\r\n"
            try:
                connection.sendall(head)
                while not stop.is_set():
                    connection.sendall(b"[" + b"1.0, " * 20000)
            except OSError:
                return

    return handle


@pytest.mark.parametrize(("declare_length", "message"), [(True, "declares 100000000 bytes"), (False, "is larger than")])
def test_http_reward_refuses_an_answer_over_max_response_bytes(declare_length, message):
    with raw_service(endless_body(declare_length)) as url:
        error = call_bounded(http_from_yaml(url, timeout_s=20, retries=2, max_response_bytes=1000))
    assert isinstance(error, RewardError), error
    assert f"reward 'scorer': the answer from {url} {message}" in str(error) and "max_response_bytes 1000" in str(error)


def test_http_reward_never_follows_a_redirect(service):
    target = service  # a working service: following the redirect would score the responses
    location = target.encode()

    def redirect(connection, stop):
        with connection:
            read_request(connection)
            connection.sendall(b"HTTP/1.1 302 Found\r\nLocation: " + location + b"\r\nContent-Length: 0\r\n\r\n")

    with raw_service(redirect) as url:
        error = call_bounded(http_from_yaml(url, retries=2))
    assert isinstance(error, RewardError), error
    assert f"the service at {url} answered HTTP 302, a redirect to {target!r}; redirects are not followed" in str(error)
    assert RewardService.requests == []  # neither followed nor retried


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://127.0.0.1/score", "127.0.0.1:8080/score", "http:///x"])
def test_reward_url_must_be_http_or_https(url):
    with pytest.raises(ValueError, match="must be an http:// or https:// address with a host"):
        RewardConfig(url=url)
    with pytest.raises(ValueError, match="must be an http:// or https:// address with a host"):
        RewardConfig(components=[{"url": url}])
    with pytest.raises(RewardError, match=r"reward.url: .* must be an http:// or https:// address"):
        HttpReward(url, timeout_s=1, retries=0, backoff_s=0)

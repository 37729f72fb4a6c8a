"""The HTTP reward service (`reward.url`), against real servers on 127.0.0.1: a scripted service (built
from the YAML section; retries, a down server, answers of the wrong length, NaN, non-JSON, strings or
other non-numbers where rewards belong) and raw TCP servers for the client's hard limits (a status line,
headers or a body dripped a byte at a time over HTTP/1.0, HTTP/1.1 keep-alive, `Connection: close` and
chunked; a dripped TLS handshake; a huge answer; a redirect; a non-HTTP address).

Every raw server is bounded on its own (it drips a fixed number of bytes, and stops with the test), so a
client that waited for it would fail the test by taking the answer late, never hang it."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from astrai.config.loader import parse_yaml
from astrai.config.schema import RewardConfig
from astrai.rollout.http_reward import HttpReward
from astrai.rollout.rewards import RewardError, WeightedReward, build_reward
from tests.unit.rollout.test_rewards import DEVICE, INPUTS


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
            "strings": {"rewards": ["a", "b"]},
            "bare_strings": ["a", "b"],
            "null": {"rewards": [1.0, None]},
            "booleans": [True, False],
            "text": {"rewards": "1.0, 3.0"},
            "nested": {"rewards": [[1.0], [3.0]]},
        }
        if step == "html":
            payload = b"<html><body>502 Bad Gateway (from a proxy, with status 200)</body></html>"
        else:
            payload = json.dumps(
                answers.get(step, {"rewards": lengths})
            ).encode()  # json writes NaN as the bare token NaN
        send_json(self, payload)

    def log_message(self, *args):
        pass


def send_json(handler: BaseHTTPRequestHandler, payload: bytes) -> None:
    """A 200 answer of `payload` as JSON, its length declared: what a working reward service sends."""
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(payload)))
    handler.end_headers()
    handler.wfile.write(payload)


@contextlib.contextmanager
def serving(handler_class):
    """A real HTTP server of `handler_class` on 127.0.0.1 (a free port) while inside: yields its /score URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler_class)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/score"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def service():
    RewardService.plan, RewardService.requests = [], []
    with serving(RewardService) as url:
        yield url


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


@pytest.mark.parametrize(
    ("answer", "came"),
    [
        ("strings", 'item 0 is a string "a" (2 of 2 items are not numbers)'),
        ("bare_strings", 'item 0 is a string "a" (2 of 2 items are not numbers)'),
        ("null", "item 1 is null (1 of 2 items are not numbers)"),
        ("booleans", "item 0 is a boolean true (2 of 2 items are not numbers)"),
        ("text", 'got a string "1.0, 3.0"'),
        ("nested", "item 0 is a list [1.0] (2 of 2 items are not numbers)"),
    ],
)
def test_http_reward_an_answer_that_is_not_numbers_names_the_service(service, answer, came):
    """Before: `["a", "b"]` reached torch and stopped the run with "too many dimensions 'str'"."""
    RewardService.plan = [answer]
    with pytest.raises(RewardError) as caught:
        http_from_yaml(service, retries=2, retry_backoff_s=0.01)(INPUTS)
    assert str(caught.value) == (
        f"reward 'scorer': the service at {service} answered rewards that are not a list of 2 numbers "
        f"(one per response): {came}"
    )
    assert len(RewardService.requests) == 1  # the service is up and answering: not retried


# ----------------------------------------------------------------------------- hard limits of the HTTP client


def serve_raw(handle):
    """A TCP server on 127.0.0.1 whose every connection runs `handle(connection, stop)` in its own thread."""
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
def raw_service(handle, scheme="http"):
    listener, stop = serve_raw(handle)
    try:
        yield f"{scheme}://127.0.0.1:{listener.getsockname()[1]}/score"
    finally:
        stop.set()
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() in progress (a close alone does not)
        listener.close()


def read_request(connection) -> bool:
    """Read one request's head and body (Content-Length) so that the client's send completes; False if
    the client went away first."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = connection.recv(65536)
        if not chunk:
            return False
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    length = int(next(line.split(b":")[1] for line in lines if line.lower().startswith(b"content-length")))
    while len(body) < length:
        chunk = connection.recv(65536)
        if not chunk:
            return False
        body += chunk
    return True


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


DRIP_S = 0.5  # one byte every DRIP_S: each byte well inside timeout_s 1, so no per-read timeout ever trips
ANSWER = b'{"rewards": [1.0, 3.0]}'  # the right answer to INPUTS: only its pace is wrong
HEADS = {  # status line and headers, sent at once; then ANSWER dripped; then the tail
    "http10": (b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n", b""),
    "http11_keep_alive": (b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(ANSWER), b""),
    "http11_connection_close": (b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n", b""),
    "http11_chunked": (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n" % len(ANSWER), b"\r\n0\r\n\r\n"),
    "http11_headers": (b"HTTP/1.1 200 OK\r\nX-Slow: ", b"\r\nContent-Length: 0\r\n\r\n"),  # ANSWER as a header
}


def dripping(head: bytes, tail: bytes, accepted: list[float]):
    """A server that sends `head`, then ANSWER one byte every DRIP_S, then `tail`: bounded, it is done after
    len(ANSWER) x DRIP_S = 11.5 s at the latest (or when the test stops it, or the client goes away).
    `accepted` gets the time of every connection."""

    def handle(connection, stop):
        accepted.append(time.monotonic())
        with connection:
            try:
                if not read_request(connection):
                    return
                connection.sendall(head)
                for byte in ANSWER:
                    if stop.wait(DRIP_S):
                        return
                    connection.sendall(bytes([byte]))
                connection.sendall(tail)
            except OSError:  # the client shut its end down: its attempt is over
                return

    return handle


def attempt_durations(started: float, accepted: list[float], ended: float, backoff_s: float) -> list[float]:
    """Seconds of each attempt of one call: from its connect to the next one's (less the wait between) or to
    the end of the call."""
    starts = [started] + accepted[1:]
    ends = [moment - backoff_s * 2**position for position, moment in enumerate(accepted[1:])] + [ended]
    return [end - start for start, end in zip(starts, ends)]


@pytest.mark.parametrize("protocol", list(HEADS))
def test_http_reward_timeout_bounds_each_attempt_against_a_dripping_server(protocol):
    """`timeout_s` bounds each whole attempt however the server answers. Before, an answer that will close
    the connection (HTTP/1.0, `Connection: close`) made http.client drop its socket in getresponse(), the
    deadline found nothing to shut down, and the dripped body was awaited for as long as it took."""
    accepted: list[float] = []
    with raw_service(dripping(*HEADS[protocol], accepted)) as url:
        started = time.monotonic()
        error = call_bounded(http_from_yaml(url, timeout_s=1, retries=1, retry_backoff_s=0.01))
        ended = time.monotonic()
    durations = attempt_durations(started, accepted, ended, backoff_s=0.01)
    print(f"{protocol}: attempts of {', '.join(f'{duration:.3f}' for duration in durations)} s")  # -s shows it
    assert isinstance(error, RewardError), f"{error!r} after {ended - started:.1f} s"  # not the answer, 11.5 s late
    message = str(error)
    assert re.fullmatch(
        rf"reward 'scorer': no answer after 2 attempts in 2\.\d s from {re.escape(url)} \(last error: no complete "
        r"answer within timeout_s 1 s\); is the reward service running and reachable from every rank\?",
        message,
    ), message
    assert len(durations) == 2 and all(0.95 < duration < 1.5 for duration in durations), durations


def test_http_reward_timeout_bounds_a_dripping_tls_handshake():
    """https://: a server that announces a 64-byte handshake record and drips it. The handshake runs before
    http.client holds a socket; it is bounded twice: ssl's own handshake deadline (the socket timeout,
    which connect() sets to what is left of the attempt), and the Deadline, which watches the TCP socket
    from before the handshake."""
    accepted: list[float] = []

    def handle(connection, stop):
        accepted.append(time.monotonic())
        with connection:
            try:
                if not connection.recv(65536):  # the ClientHello
                    return
                connection.sendall(b"\x16\x03\x03\x00\x40")  # a handshake record of 64 bytes follows
                for _ in range(64):
                    if stop.wait(DRIP_S):
                        return
                    connection.sendall(b"\x00")
            except OSError:
                return

    with raw_service(handle, scheme="https") as url:
        started = time.monotonic()
        error = call_bounded(http_from_yaml(url, timeout_s=1, retries=0))
        ended = time.monotonic()
    print(f"tls_handshake: attempt of {ended - started:.3f} s")
    assert isinstance(error, RewardError), error
    assert f"no answer after 1 attempt in 1.0 s from {url} (last error: no complete answer within timeout_s 1 s)" in (
        str(error)
    )
    assert len(accepted) == 1 and 0.95 < ended - started < 1.5


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

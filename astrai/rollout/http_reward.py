"""The `reward.url` source: an HTTP reward service, with hard limits so that a misbehaving service
fails the run instead of hanging or flooding it (the protocol is HttpReward's docstring; every reward
source's arguments are listed in `astrai.rollout.rewards`)."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.parse

from astrai.rollout.rewards import RewardError

RETRYABLE_HTTP_STATUS = {408, 429, 500, 502, 503, 504}
HTTP_SCHEMES = ("http", "https")
DEFAULT_MAX_RESPONSE_BYTES = 16 * 2**20  # reward.max_response_bytes: a few floats per response fit many times over
RESPONSE_CHUNK_BYTES = 64 * 2**10


class HttpReward:
    """`url`: POST {"prompts", "responses", "prompt_ids", "response_ids", "messages", "rows"} as JSON;
    the service answers {"rewards": [float, ...]} (or the bare list). Connection failures, timeouts and
    HTTP 408/429/5xx are retried `retries` times with doubling waits; other HTTP errors are not.

    Hard limits, so that a misbehaving service fails the run instead of hanging or flooding it:
    `timeout_s` bounds each whole attempt (connect, send, status, headers and body), even against a
    server that drips a byte at a time; an answer over `max_response_bytes` is an error; a redirect
    (3xx) is an error naming where it points, never followed; only http:// and https:// are spoken.
    Proxy variables of the environment (http_proxy, ...) are not used: the service is reached directly.
    """

    def __init__(
        self,
        url: str,
        timeout_s: float,
        retries: int,
        backoff_s: float,
        name: str | None = None,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
    ):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in HTTP_SCHEMES or not parts.hostname:
            raise RewardError(f"reward.url: {url!r} must be an http:// or https:// address with a host")
        self.url, self.timeout_s, self.retries, self.backoff_s = url, timeout_s, retries, backoff_s
        self.max_response_bytes = max_response_bytes
        self.name = name or url

    def __call__(self, inputs: dict[str, list]) -> list[float]:
        body = json.dumps(inputs).encode()
        started, last_error = time.monotonic(), None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                status, raw = self.post(body)
            except (OSError, http.client.HTTPException) as error:  # refused, reset, timed out, cut short
                last_error = f"{type(error).__name__}: {error}" if not isinstance(error, TimeoutError) else str(error)
                continue
            if status == 200:
                return self.rewards_of(raw, len(inputs["responses"]))
            if status not in RETRYABLE_HTTP_STATUS:
                detail = raw[:300].decode(errors="replace")
                raise RewardError(f"reward {self.name!r}: the service at {self.url} answered HTTP {status}: {detail}")
            last_error = f"HTTP {status}"
        attempts = f"{self.retries + 1} attempt{'s' if self.retries else ''}"
        raise RewardError(
            f"reward {self.name!r}: no answer after {attempts} in {time.monotonic() - started:.1f} s "
            f"from {self.url} (last error: {last_error}); is the reward service running and reachable from every rank?"
        )

    def post(self, body: bytes) -> tuple[int, bytes]:
        """One POST within `timeout_s` in all: (status, body). A `Deadline` shuts the socket down when
        `timeout_s` has passed, which wakes any read or write in progress (http.client's own timeout is per
        read, so a server sending a byte every few seconds would never trip it). Redirects and oversized
        answers raise RewardError (not retried); a missed deadline raises TimeoutError (retried)."""
        parts = urllib.parse.urlsplit(self.url)
        connection_class = _DeadlineHTTPSConnection if parts.scheme == "https" else _DeadlineHTTPConnection
        deadline = Deadline(self.timeout_s)
        connection = connection_class(parts.hostname, parts.port, timeout=self.timeout_s)
        connection.deadline, response = deadline, None
        try:
            path = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
            headers = {"Content-Type": "application/json", "Accept": "application/json"}
            connection.request("POST", path, body=body, headers=headers)
            response = connection.getresponse()
            if 300 <= response.status < 400:
                raise RewardError(
                    f"reward {self.name!r}: the service at {self.url} answered HTTP {response.status}, a redirect to "
                    f"{response.getheader('Location')!r}; redirects are not followed: "
                    "set reward.url to the final address"
                )
            answer = response.status, self.read_body(response)
        except (OSError, http.client.HTTPException) as error:
            # A socket timeout is the deadline too: connect() set it to what was left of the attempt
            if deadline.expired or isinstance(error, TimeoutError):
                raise deadline.error() from None
            raise
        finally:
            deadline.close()  # before closing the sockets: the timer never touches a closed one
            if response is not None:
                response.close()
            connection.close()
        if deadline.expired:  # the shut-down socket may read as a clean end of headers or body: never trust that
            raise deadline.error()
        return answer

    def read_body(self, response: http.client.HTTPResponse) -> bytes:
        """The body in chunks, refused as soon as it passes `max_response_bytes` (declared or read)."""
        limit = self.max_response_bytes
        declared = response.getheader("Content-Length")
        if declared is not None and declared.strip().isdigit() and int(declared) > limit:
            raise RewardError(
                f"reward {self.name!r}: the answer from {self.url} declares {int(declared)} bytes, "
                f"more than max_response_bytes {limit}"
            )
        chunks, size = [], 0
        while chunk := response.read(min(RESPONSE_CHUNK_BYTES, limit + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise RewardError(
                    f"reward {self.name!r}: the answer from {self.url} is larger than max_response_bytes {limit}"
                )
        return b"".join(chunks)

    def rewards_of(self, raw: bytes, expected: int) -> list[float]:
        """The rewards in a 200 answer: a JSON list of numbers, bare or as {"rewards": [...]}. A body that
        is not that is not retried (the service is up and answering something else: a proxy's HTML page, a
        wrong route, labels instead of scores). Length and finiteness are checked by `checked_scores`, as
        for every source."""
        try:
            answer = json.loads(raw)
            rewards = answer["rewards"] if isinstance(answer, dict) else answer
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as error:
            raise RewardError(
                f"reward {self.name!r}: the answer is not JSON with a 'rewards' list ({type(error).__name__}: "
                f"{error}); it began {raw[:120]!r}"
            ) from None
        # JSON true/false are not numbers (Python would take them for 1 and 0); NaN is left to checked_scores
        if not isinstance(rewards, list):
            came = f"got {_described(rewards)}"
        else:
            bad = [position for position, item in enumerate(rewards) if not _is_number(item)]
            if not bad:
                return rewards
            first = _described(rewards[bad[0]])
            came = f"item {bad[0]} is {first} ({len(bad)} of {len(rewards)} items are not numbers)"
        raise RewardError(
            f"reward {self.name!r}: the service at {self.url} answered rewards that are not a list of {expected} "
            f"numbers (one per response): {came}"
        )


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _described(value, limit: int = 60) -> str:
    """A decoded JSON value as its kind and its JSON text, one line, cut to `limit` characters:
    'a string "a"', 'an object {"score": 1}', 'null'."""
    if value is None:
        return "null"
    kinds = {str: "a string", bool: "a boolean", dict: "an object", list: "a list", int: "a number", float: "a number"}
    text = json.dumps(value, ensure_ascii=True)
    return f"{kinds.get(type(value), type(value).__name__)} {text if len(text) <= limit else text[: limit - 3] + '...'}"


class Deadline:
    """The bound on one whole HTTP attempt: `seconds` after it is made, every socket handed to `watch`
    is shut down (both directions), which ends whatever read or write blocks on it at once: a read sees
    the end of the stream, a write a broken pipe.

    Why a socket of our own: http.client forgets its socket (`connection.sock = None`) inside
    getresponse() when the answer will close the connection (HTTP/1.0, `Connection: close`) and reads
    the body through a file made from it, and ssl detaches the plain socket it wraps; a timer that looked
    for `connection.sock` found nothing to shut down, and a body dripped a byte a second held the run
    forever. `watch` keeps a duplicate of the descriptor, taken right after the TCP connect (before TLS)
    and closed only by `close`: a shutdown acts on the connection behind every descriptor of it, whoever
    holds the others and whatever they wrap it in. A per-read timeout cannot give this bound (a dripping
    server restarts it with every byte), nor can a deadline checked between our own reads (http.client
    reads the status line and headers itself). The lock orders the timer and `close`: no shutdown after
    `close` has released a duplicate, whose number may already belong to another socket.
    """

    def __init__(self, seconds: float):
        self.seconds, self.ends = seconds, time.monotonic() + seconds
        self.expired, self.finished, self.handles = False, False, []
        self.lock = threading.Lock()
        self.timer = threading.Timer(seconds, self.expire)
        self.timer.daemon = True
        self.timer.start()

    def remaining(self) -> float:
        return self.ends - time.monotonic()

    def error(self) -> TimeoutError:
        return TimeoutError(f"no complete answer within timeout_s {self.seconds:g} s")

    def watch(self, sock: socket.socket) -> None:
        """Shut `sock` down at the deadline (now, if it has passed: a connect that ended after it)."""
        handle = sock.dup()
        with self.lock:
            if not self.expired and not self.finished:
                self.handles.append(handle)
                return
        handle.close()
        raise self.error()

    def expire(self) -> None:
        with self.lock:
            if self.finished:
                return
            self.expired = True
            for handle in self.handles:
                try:
                    handle.shutdown(socket.SHUT_RDWR)
                except OSError:  # the peer already closed it
                    pass

    def close(self) -> None:
        """The attempt is over: stop the timer and release the duplicates (never shuts anything down)."""
        self.timer.cancel()
        with self.lock:
            self.finished = True
            handles, self.handles = self.handles, []
        for handle in handles:
            handle.close()


class _DeadlineHTTPConnection(http.client.HTTPConnection):
    """An HTTPConnection whose TCP socket is watched by `self.deadline` from the moment it connects."""

    deadline: Deadline

    def connect(self) -> None:
        # Each address's connect gets only what is left of the attempt (the timer cannot reach a socket
        # that is still connecting); a connect that succeeds after the deadline is refused by `watch`.
        self.timeout = max(self.deadline.remaining(), 0.001)
        super().connect()  # in _DeadlineHTTPSConnection: http.client.HTTPConnection.connect, plain TCP
        self.deadline.watch(self.sock)


class _DeadlineHTTPSConnection(http.client.HTTPSConnection, _DeadlineHTTPConnection):
    """HTTPS: HTTPSConnection.connect calls super().connect() (the method above, by this MRO: the TCP
    socket is watched before the TLS handshake, which the deadline therefore bounds too), then wraps it."""

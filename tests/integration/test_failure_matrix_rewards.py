"""The failure matrix of the reward sources (issue #38), in the manner of test_failure_matrix.py: each bad
reward ends `astrai.train.main` (one rank, in this process) with ONE line naming the reward's module or
service, and an exit code; no traceback, never a hang, never silent.

Exit 2, before any rank starts (the output folder is not even created): a reward module that calls
sys.exit while it is imported. Exit 1, at the first rollout of a grpo run: an HTTP reward service that
drips its body a byte at a time (HTTP/1.0, so http.client gives up its socket in getresponse(): the
case that used to hang), and one that answers labels where numbers belong.

The servers are real, on 127.0.0.1, and bounded on their own: the dripping one sends the whole answer
in 11.5 s at the latest, so a client without the bound fails the test by taking that answer late.
"""

from __future__ import annotations

import json
import logging
import os
import time
from http.server import BaseHTTPRequestHandler

import pytest

from tests.conftest import REPO
from tests.integration.test_failure_matrix import Case, assert_one_clear_line, run_main, write_case
from tests.unit.rollout.test_http_reward import HEADS, dripping, raw_service, send_json, serving

PROMPTS = 8
GRPO = [
    "train.train_type=grpo",
    "train.max_steps=1",
    "train.micro_batch_size=4",
    "rollout={prompts_per_step: 2, group_size: 2, max_new_tokens: 4}",
]  # one rollout of 4 responses, scored once


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """test_failure_matrix's `folder`, with the arithmetic prompts ({"prompt", "answer"}) an online run
    reads instead of chats; the process environment and logging restored afterwards."""
    lines = (REPO / "data/arithmetic/prompts_64.jsonl").read_text().splitlines()[:PROMPTS]
    (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # reward modules written there import like a user's
    saved = dict(os.environ)
    yield tmp_path
    os.environ.clear()
    os.environ.update(saved)
    logging.getLogger().handlers.clear()


def test_reward_module_that_exits_while_imported(folder, capfd):
    """Before: SystemExit is no Exception, so it left main() and the process ended with the module's own
    words ("no GPU on this node") and nothing naming the reward module or the job file."""
    module = "import sys\n\nprint('checking the node')\nsys.exit('no GPU on this node')\n"
    case = Case("reward_module_exits_at_import", [], "", 2, {"exiting_reward.py": module})
    overrides = GRPO + ["reward={function: 'exiting_reward:score'}"]
    code, output = run_main(write_case(folder, case), overrides, capfd)
    assert code == 2, output[-3000:]
    fragment = (
        f"reward.function: {folder / 'exiting_reward.py'}:4: the module exited while being imported, with "
        "sys.exit('no GPU on this node') (importing 'exiting_reward' for 'exiting_reward:score')"
    )
    line = assert_one_clear_line(output, fragment, 2)
    assert str(folder / "job.yaml") in line, line
    assert not (folder / "run").exists(), "a job refused before any rank starts wrote into its output folder"


def test_reward_service_that_drips_its_answer(folder, capfd):
    """HTTP/1.0 (the answer will close the connection), the body dripped a byte every 0.5 s: the run stops
    at reward.timeout_s (1 s, retries 0) after the service took the request, naming service and timeout."""
    accepted: list[float] = []
    with raw_service(dripping(*HEADS["http10"], accepted)) as url:
        overrides = GRPO + [f"reward={{url: '{url}', timeout_s: 1, retries: 0}}"]
        code, output = run_main(write_case(folder, Case("", [], "", 1)), overrides, capfd)
        returned = time.monotonic()
    assert code == 1, output[-3000:]
    fragment = (
        f"reward '{url}': no answer after 1 attempt in 1.0 s from {url} (last error: no complete answer within "
        "timeout_s 1 s)"
    )
    assert_one_clear_line(output, fragment, 1)
    assert len(accepted) == 1, accepted
    print(f"dripping service: main() returned {returned - accepted[0]:.2f} s after the request was taken")
    assert returned - accepted[0] < 4, "the run did not stop at the reward's timeout"  # 11.5 s: the whole drip
    assert not list((folder / "run").glob("checkpoints/step_*"))


class LabelService(BaseHTTPRequestHandler):
    """Answers a label per response ("correct" or "wrong"), where the protocol wants numbers."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        labels = [
            "correct" if response.strip() == row["answer"] else "wrong"
            for response, row in zip(body["responses"], body["rows"])
        ]
        send_json(self, json.dumps({"rewards": labels}).encode())

    def log_message(self, *args):
        pass


def test_reward_service_that_answers_labels(folder, capfd):
    """Before: the labels reached torch and the run stopped with "too many dimensions 'str'"."""
    with serving(LabelService) as url:
        overrides = GRPO + [f"reward={{url: '{url}', name: verifier}}"]
        code, output = run_main(write_case(folder, Case("", [], "", 1)), overrides, capfd)
    assert code == 1, output[-3000:]
    fragment = (
        f"reward 'verifier': the service at {url} answered rewards that are not a list of 4 numbers (one per "
        'response): item 0 is a string "'
    )
    line = assert_one_clear_line(output, fragment, 1)
    assert "(4 of 4 items are not numbers)" in line and "too many dimensions" not in line, line

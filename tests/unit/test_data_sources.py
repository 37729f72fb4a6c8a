"""Data files through `datasets`: parquet and arrow beside jsonl, folders and globs in one sorted order,
and malformed rows skipped and counted (data.on_bad_row: skip) by a real single-rank build."""

from __future__ import annotations

import json
import logging

import datasets
import pyarrow as pa
import pytest

from astrai.build import build_run
from astrai.config import load_job
from astrai.data.sources import DataError, find_files, load_rows
from tests.conftest import REPO

CHATS = [json.loads(line) for line in (REPO / "data/arithmetic/sft.jsonl").read_text().splitlines()[:12]]


def write_formats(folder):
    """The same 12 chats split over a jsonl, a parquet and an arrow (IPC stream) file."""
    folder.mkdir()
    (folder / "a.jsonl").write_text("".join(json.dumps(row) + "\n" for row in CHATS[:4]))
    datasets.Dataset.from_list(CHATS[4:8]).to_parquet(str(folder / "b.parquet"))
    table = datasets.Dataset.from_list(CHATS[8:]).data.table
    with pa.OSFile(str(folder / "c.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)


def test_parquet_and_arrow_load_beside_jsonl_in_one_sorted_order(tmp_path):
    folder = tmp_path / "mixed"
    write_formats(folder)
    (folder / "notes.txt").write_text("not data")
    assert [f.name for f in find_files(str(folder))] == ["a.jsonl", "b.parquet", "c.arrow"]
    rows = load_rows(str(folder), "auto", tmp_path / "cache")
    assert [row["messages"] for row in rows.dataset] == [chat["messages"] for chat in CHATS]
    assert rows.locate(5) == f"{folder / 'b.parquet'} row 2" and rows.locate(11) == f"{folder / 'c.arrow'} row 4"
    globbed = load_rows(str(folder / "*.parquet"), "auto", tmp_path / "cache")
    assert len(globbed.dataset) == 4


def test_unreadable_file_and_empty_path_are_named(tmp_path):
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet")
    with pytest.raises(DataError, match=rf"{broken}: cannot read as parquet"):
        load_rows(str(broken), "auto", tmp_path / "cache")
    with pytest.raises(DataError, match="data.path: no json/jsonl/parquet/arrow file found"):
        find_files(str(tmp_path / "nothing*"))


JOB = """\
output_dir: {output_dir}
model:
  init: {{model_type: llama, hidden_size: 16, intermediate_size: 32, num_hidden_layers: 1, num_attention_heads: 2, max_position_embeddings: 64}}
tokenizer: {{build: {{kind: char}}}}
data: {{path: {data}, max_seq_len: 32, on_bad_row: skip}}
train: {{train_type: sft, max_steps: 1, micro_batch_size: 2, lr: 1e-3}}
runtime: {{progress_bar: false, tensorboard: false}}
"""


def test_skipped_rows_are_counted_and_logged(tmp_path, one_rank, caplog):
    bad = [{"messages": [{"role": "user", "content": "1+1="}]}, {"messages": "not a list"}]  # no reply; not a chat at all
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in CHATS[:6] + bad))
    config = tmp_path / "job.yaml"
    config.write_text(JOB.format(output_dir=tmp_path / "out", data=data))
    with caplog.at_level(logging.WARNING, logger="astrai"):
        run = build_run(load_job(config), one_rank, str(config))
    assert run.skipped_rows == 2 and len(run.dataset) == 6
    assert "skipped 2 malformed rows (data.on_bad_row: skip)" in caplog.text

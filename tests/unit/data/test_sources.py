"""Data files through `datasets`: parquet and arrow beside jsonl, folders and globs in one sorted order,
and malformed rows skipped and counted (data.on_bad_row: skip) by a real single-rank build."""

from __future__ import annotations

import json
import logging

import datasets
import pyarrow as pa
import pytest

from astrai.config import load_job
from astrai.data.sources import DataError, find_files, load_rows
from astrai.training.build import build_run
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


@pytest.mark.parametrize("name, content", [("empty.jsonl", b""), ("blank.jsonl", b"\n  \n"), ("empty.parquet", b"")])
def test_an_empty_file_is_named_as_empty(tmp_path, name, content):
    """datasets' own error for one is `cannot read as json: ` with an empty reason."""
    (tmp_path / name).write_bytes(content)
    with pytest.raises(DataError) as raised:
        load_rows(str(tmp_path / name), "auto", tmp_path / "cache")
    assert str(raised.value) == f"{tmp_path / name}: the file is empty: no rows to read"


JOB = """\
output_dir: {output_dir}
model:
  init: {{model_type: llama, hidden_size: 16, intermediate_size: 32, num_hidden_layers: 1, num_attention_heads: 2,
          max_position_embeddings: 64}}
tokenizer: {{build: {{kind: char}}}}
data: {{path: {data}, max_seq_len: 32, on_bad_row: skip}}
train: {{train_type: sft, max_steps: 1, micro_batch_size: 2, lr: 1e-3}}
runtime: {{progress_bar: false, tensorboard: false}}
"""


def test_skipped_rows_are_counted_and_logged(tmp_path, one_rank, caplog):
    bad = [
        {"messages": [{"role": "user", "content": "1+1="}]},
        {"messages": "not a list"},
    ]  # no reply; not a chat at all
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in CHATS[:6] + bad))
    config = tmp_path / "job.yaml"
    config.write_text(JOB.format(output_dir=tmp_path / "out", data=data))
    with caplog.at_level(logging.WARNING, logger="astrai"):
        run = build_run(load_job(config), one_rank, str(config))
    assert len(run.dataset) == 6  # 8 rows written, the 2 malformed ones skipped
    assert "skipped 2 malformed rows (data.on_bad_row: skip)" in caplog.text


def test_a_column_of_mixed_types_never_changes_a_value_silently(tmp_path):
    """datasets keeps a JSON column of several types as JSON text and decodes it on read, so "2" would come
    back as the number 2: refused, naming the file, row, column and both values. A column of mixed types
    whose values all come back as written (a malformed row among chats) loads, for data.on_bad_row."""
    answers = tmp_path / "answers.jsonl"
    answers.write_text(
        '{"prompt": "1+1=", "answer": "x"}\n{"prompt": "1+2=", "answer": "3"}\n{"prompt": "2+2=", "answer": 4}\n'
    )
    with pytest.raises(
        DataError,
        match=r"answers\.jsonl: row 2, column 'answer': datasets read '3' as 3: the column has values of different "
        r"types",
    ):
        load_rows(str(answers), "auto", tmp_path / "cache")
    as_document = tmp_path / "answers.json"
    as_document.write_text(json.dumps([{"answer": "true"}, {"answer": [1]}]))
    with pytest.raises(DataError, match=r"row 1, column 'answer': datasets read 'true' as True"):
        load_rows(str(as_document), "auto", tmp_path / "cache")
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(row) + "\n" for row in [*CHATS[:2], {"messages": "not a list"}]))
    rows = load_rows(str(chats), "auto", tmp_path / "cache")
    assert [row["messages"] for row in rows.dataset] == [CHATS[0]["messages"], CHATS[1]["messages"], "not a list"]
    numbers = tmp_path / "numbers.jsonl"  # ints and floats are one type to datasets (float64): nothing to check
    numbers.write_text('{"x": 1}\n{"x": 2.5}\n{"x": null}\n')
    assert load_rows(str(numbers), "auto", tmp_path / "cache").dataset["x"] == [1.0, 2.5, None]

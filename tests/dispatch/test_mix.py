"""Request mixes (ByteCross App. I) and users' traces."""

import numpy as np
import pytest

from sparsedecode.dispatch.mix import get_mix, read_trace, workload
from sparsedecode.errors import InputError


def test_mixed_workload_is_app_i():
    m = workload("mixed", seed=0)
    assert len(m) == 2000
    chat, doc, agent = m.prompt[:1400], m.prompt[1400:1800], m.prompt[1800:]
    assert set(m.answer[:1400]) == {256} and set(m.answer[1400:1800]) == {128} and set(m.answer[1800:]) == {1024}
    assert chat.min() >= 64 and chat.max() <= 32768
    assert abs(np.median(chat) / 1024 - 1) < 0.05  # lognormal of median 1K
    assert abs(np.std(np.log(chat[(chat > 64) & (chat < 32768)])) - 1.1) < 0.1
    assert doc.min() >= 32768 and doc.max() <= 131072 and agent.min() >= 16384 and agent.max() <= 98304
    assert abs(doc.mean() - (32768 + 131072) / 2) < 2000  # uniform


def test_workloads_are_seeded():
    a, b, c = workload("chat", 3), workload("chat", 3), workload("chat", 4)
    assert np.array_equal(a.prompt, b.prompt) and not np.array_equal(a.prompt, c.prompt)
    assert len(workload("long_doc")) == 500 and len(workload("agent")) == 500
    with pytest.raises(InputError, match="not one of mixed"):
        workload("bursty")


def test_jsonl_and_csv_traces(tmp_path):
    j = tmp_path / "t.jsonl"
    j.write_text('{"prompt_tokens": 100, "answer_tokens": 20}\n\n{"prompt_tokens": 5000, "answer_tokens": 7}\n')
    m = get_mix(str(j))
    assert m.prompt.tolist() == [100, 5000] and m.answer.tolist() == [20, 7]
    c = tmp_path / "t.csv"
    c.write_text("answer_tokens,prompt_tokens,route\n20,100,a\n7,5000,b\n")
    assert read_trace(c).prompt.tolist() == [100, 5000]


@pytest.mark.parametrize("text, where", [
    ('{"prompt_tokens": 100, "answer_tokens": 20}\n{"prompt_tokens": -3, "answer_tokens": 2}\n', "line 2"),
    ('{"prompt_tokens": 100, "answer_tokens": 20}\n{"prompt_tokens": 1.5, "answer_tokens": 2}\n', "line 2"),
    ('{"prompt_tokens": 100, "answer_tokens": 20}\nnot json\n', "line 2: not a JSON object"),
    ('{"prompt_tokens": 100}\n', "line 1"),
    ("prompt_tokens,answer_tokens\n1,2\n3,x\n", "line 3"),
    ("prompt_tokens,answer_tokens\n1,2,3\n", "line 2"),
    ("prompt,answer\n1,2\n", "lacks prompt_tokens, answer_tokens"),
])
def test_a_bad_row_is_refused_with_its_line(tmp_path, text, where):
    f = tmp_path / "bad.jsonl"
    f.write_text(text)
    with pytest.raises(InputError, match=where):
        read_trace(f)


def test_unreadable_traces(tmp_path):
    with pytest.raises(InputError, match="not found"):
        read_trace(tmp_path / "none.jsonl")
    f = tmp_path / "latin1.csv"
    f.write_bytes(b"prompt_tokens,answer_tokens\n1,2\n\xff\n")
    with pytest.raises(InputError, match="not UTF-8"):
        read_trace(f)
    with pytest.raises(InputError, match="folder"):
        read_trace(tmp_path)

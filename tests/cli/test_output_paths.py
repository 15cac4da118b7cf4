"""Every option that writes a file or a folder is checked while the command line is read (issue
48, item 3): a folder where a file goes (or a file where a folder goes), a parent that is a file,
and a place that cannot be written are refused in one line with exit code 2, before any work (no
model loads, the command itself never starts). Folders missing below a writable one are made on
write, so they pass."""

from __future__ import annotations

import os

import pytest

from conftest import cli_commands, run_cli

# (command words, flag, what it writes: file / dir / either, the suffix a file must have)
OUTPUTS = [
    ("account plot", "--out", "file", ".png"),
    ("bench cell", "--out", "file", ".json"),
    ("bench ceiling", "--out", "file", ".json"),
    ("bench union", "--out", "file", ".json"),
    ("calibrate", "--out", "file", ".safetensors"),
    ("campaign plan-crossing", "--prediction", "file", ".json"),
    ("campaign plan-crossing", "--spec", "file", ".toml"),
    ("campaign run", "--out", "dir", None),
    ("campaign run", "--out-root", "dir", None),
    ("dispatch check", "--out", "file", ".json"),
    ("dispatch price", "--plot", "file", ".png"),
    ("dispatch table", "--out", "file", ".json"),
    ("eval grid", "--out", "dir", None),
    ("finetune", "--out", "dir", None),
    ("eval multikey", "--out", "file", ".json"),
    ("eval passkey", "--out", "file", ".json"),
    ("eval ppl", "--out", "file", ".json"),
    ("eval two-turn", "--out", "file", ".json"),
    ("report", "--out", "either", None),
    ("route build", "--out", "file", ".safetensors"),
    ("serve", "--ready-file", "file", ".json"),
    ("serve-load", "--out", "file", ".json"),
    ("serve-probe", "--out", "file", ".json"),
]
WRITES = ("--out", "--out-root", "--plot", "--prediction", "--spec", "--ready-file")


def test_the_table_holds_every_option_that_writes():
    found = {(" ".join(path), o) for path, cmd in cli_commands() for p in cmd.params for o in p.opts
             if o in WRITES or (o.startswith("--") and "write" in (getattr(p, "help", "") or "").lower()
                                and not getattr(p, "is_flag", False))}
    assert found == {(c, f) for c, f, _, _ in OUTPUTS}


def _cases():
    for cmd, flag, kind, suffix in OUTPUTS:
        name = "x" + (suffix or "")
        wrong = {"file": ("{t}/folder", "is a folder"), "dir": ("{t}/afile", "is a file; give a folder")}.get(kind)
        if wrong:
            yield cmd, flag, wrong[0], wrong[1]
        yield cmd, flag, "{t}/afile/" + name, "afile is a file, not a folder"
        yield cmd, flag, "{t}/locked/" + name, "cannot write under"
        yield cmd, flag, "{t}/locked/new/" + name, "cannot write under"  # a missing parent under it


@pytest.mark.parametrize("cmd, flag, value, needle", list(_cases()),
                         ids=[f"{c} {f} {v.split('/', 1)[1]}" for c, f, v, _ in _cases()])
def test_a_bad_output_path_is_refused_while_the_command_line_is_read(cmd, flag, value, needle, tmp_path, capsys,
                                                                     monkeypatch):
    import sparsedecode

    (tmp_path / "folder").mkdir()
    (tmp_path / "afile").write_text("x")
    (tmp_path / "locked").mkdir()
    locked, access = str(tmp_path / "locked"), os.access
    monkeypatch.setattr(os, "access", lambda p, mode: not str(p).startswith(locked) and access(p, mode))
    monkeypatch.setattr(sparsedecode, "load", lambda *a, **k: pytest.fail("a model loaded"))
    r = run_cli(capsys, *cmd.split(), flag, value.format(t=tmp_path))  # the command's other arguments are
    assert r.returncode == 2, r.stderr  # missing: only a parse-time check answers before click does
    assert r.stderr.startswith(f"error: {flag} ") and needle in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not r.stdout


def test_a_missing_folder_under_a_writable_one_passes(tmp_path, capsys):
    r = run_cli(capsys, "bench", "ceiling", "--out", str(tmp_path / "new" / "deeper" / "c.json"), "--gib", "0")
    assert r.returncode == 2 and "--gib" in r.stderr  # past the --out check, refused by the next

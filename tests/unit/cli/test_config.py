"""`nbaccel config` (wizard), `config show`, `config validate`, and schema-generated --help."""

from __future__ import annotations

import builtins
import importlib.util
import os
import shlex
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

import nbaccel.config.schema
from nbaccel.cli import build_parser, main
from nbaccel.cli.config import launch_flags
from nbaccel.cli.flags import explicit_values
from nbaccel.config.files import nbaccel_default_file, save
from nbaccel.config.resolve import resolve
from nbaccel.config.schema import Config, options
from nbaccel.errors import ConfigError


@pytest.fixture(autouse=True)
def _clean_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh HOME (resolve finds the default file through it) and no config variables."""
    for var in list(os.environ):
        if var.startswith(("NBACCEL_", "ACCELERATE_")) or var in (
            "XDG_CONFIG_HOME",
            "XDG_CACHE_HOME",
            "HF_HOME",
        ):
            monkeypatch.delenv(var)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("COLUMNS", "200")  # argparse help: one flag per line, no wrapping
    return home


class Answers:
    """Stands in for ``input``: answers by the option a prompt asks about, records prompts."""

    def __init__(self, answers: Mapping[str, str | list[str]], eof_at: str | None = None):
        self.queues = {k: [v] if isinstance(v, str) else list(v) for k, v in answers.items()}
        self.eof_at = eof_at
        self.prompts: list[str] = []

    def __call__(self, prompt: str) -> str:
        self.prompts.append(prompt)
        name = prompt.split(" [")[0]
        if name == self.eof_at:
            raise EOFError
        queue = self.queues.get(name, [])
        return queue.pop(0) if queue else ""

    @property
    def asked(self) -> list[str]:
        return [prompt.split(" [")[0] for prompt in self.prompts]


def run_wizard(
    monkeypatch: pytest.MonkeyPatch, answers: Answers, *extra: str
) -> tuple[int, list[str]]:
    monkeypatch.setattr(builtins, "input", answers)
    code = main(["config", *extra])
    return code, answers.asked


def show_rows(text: str) -> dict[str, tuple[str, str]]:
    rows = {}
    for line in text.splitlines()[1:]:
        path, value, source = line.split()
        rows[path] = (value, source)
    return rows


def test_show_lists_every_value_with_its_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("num_processes: 3\nfsdp:\n  cpu_offload: true\nlog_with: [csv, jsonl]\n")
    monkeypatch.setenv("NBACCEL_MIXED_PRECISION", "bf16")
    argv = ["config", "show", "--config_file", str(path), "--gradient-accumulation-steps", "4"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = show_rows(out)
    assert list(rows) == [opt.path for opt in options()]
    assert rows["num_processes"] == ("3", f"file:{path}")
    assert rows["fsdp.cpu_offload"] == ("true", f"file:{path}")
    assert rows["log_with"] == ("csv,jsonl", f"file:{path}")
    assert rows["mixed_precision"] == ("bf16", "env:NBACCEL_MIXED_PRECISION")
    assert rows["gradient_accumulation_steps"] == ("4", "argument")
    assert rows["strategy"] == ("auto", "default")
    assert rows["max_grad_norm"] == ("none", "default")
    # aligned: every value and every source starts in the same column
    header, *lines = out.splitlines()
    value_at, source_at = header.index("value"), header.index("source")
    for line, (value, source) in zip(lines, rows.values(), strict=True):
        assert line[value_at:].startswith(value + " ") and line[source_at:] == source


def test_show_reads_the_default_file_from_home(
    _clean_env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    default = nbaccel_default_file(os.environ)
    save(Config(num_machines=2, machine_rank=1), default)
    assert default.is_relative_to(_clean_env)
    assert main(["config", "show"]) == 0
    rows = show_rows(capsys.readouterr().out)
    assert rows["machine_rank"] == ("1", f"file:{default}")


def test_show_reports_a_bad_env_value_with_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("NBACCEL_NUM_PROCESSES", "two")
    assert main(["config", "show"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nbaccel: ") and "env:NBACCEL_NUM_PROCESSES" in err


def test_validate_accepts_a_good_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "good.yaml"
    path.write_text("num_processes: 2\nmixed_precision: bf16\n")
    assert main(["config", "validate", str(path)]) == 0
    assert capsys.readouterr().out.strip() == f"{path} is valid"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("num_processes: 0\n", ["num_processes", ">= 1"]),
        ("mixed_precision: fp8\n", ["mixed_precision", "'fp8'", "'no', 'fp16', 'bf16'"]),
        ("num_procs: 2\n", ["'num_procs'", "Did you mean 'num_processes'"]),
        ("fsdp:\n  sharding_strategy: ALL\n", ["fsdp_sharding_strategy", "FULL_SHARD"]),
    ],
)
def test_validate_rejects_a_bad_file_naming_file_and_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, expected: list[str]
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert main(["config", "validate", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("nbaccel: ") and str(path) in captured.err
    for part in expected:
        assert part in captured.err


def test_validate_a_missing_file_says_how_to_make_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "nope.yaml"
    assert main(["config", "validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "does not exist" in err and "nbaccel config" in err


def test_wizard_reasks_bad_answers_and_writes_a_file_that_resolves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "out" / "wizard.yaml"
    answers = Answers(
        {
            "num_processes": ["zero", "0", "2"],
            "mixed_precision": ["fp8", "bf16"],
            "use_cpu": ["perhaps", "yes"],
            "log_with": "csv, jsonl",
            "strategy": "ddp",
        }
    )
    code, asked = run_wizard(monkeypatch, answers, "--config_file", str(target))
    assert code == 0
    out = capsys.readouterr().out
    assert asked.count("num_processes") == 3 and asked.count("mixed_precision") == 2
    assert "num_processes='zero' is not a valid int" in out
    assert "num_processes must be >= 1" in out
    assert "mixed_precision='fp8' is not one of 'no', 'fp16', 'bf16'" in out
    # single machine, ddp: no multi-node questions, no fsdp or deepspeed section
    assert not {"machine_rank", "main_process_ip", "main_process_port", "rdzv_timeout"} & set(asked)
    assert not [name for name in asked if name.startswith(("fsdp.", "deepspeed."))]
    assert "runs_dir" in asked and "collective_timeout" in asked  # plain fields: always asked
    expected = Config(
        num_processes=2,
        use_cpu=True,
        mixed_precision="bf16",
        log_with=("csv", "jsonl"),
        strategy="ddp",
    )
    resolved = resolve(env={}, config=target, use_default_file=False)
    assert resolved.config == expected
    assert f"Saved {target}" in out
    assert "--num_processes 2 --use_cpu true --mixed_precision bf16 --strategy ddp" in out


def test_wizard_asks_only_the_sections_that_apply(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "fsdp.yaml"
    answers = Answers(
        {
            "num_machines": "2",
            "machine_rank": ["2", "1"],  # 2 is out of range for 2 machines: asked again
            "main_process_ip": "10.0.0.7",
            "strategy": "fsdp",
            "fsdp.sharding_strategy": "shard_grad_op",  # choices are matched ignoring case
            "fsdp.cpu_offload": "true",
        }
    )
    code, asked = run_wizard(monkeypatch, answers, "--config_file", str(target))
    assert code == 0
    assert asked.count("machine_rank") == 2
    assert {"main_process_ip", "main_process_port", "rdzv_timeout"} <= set(asked)
    assert [n for n in asked if n.startswith("fsdp.")] == [
        o.path for o in options() if o.path.startswith("fsdp.")
    ]
    assert not [name for name in asked if name.startswith("deepspeed.")]
    config = resolve(env={}, config=target, use_default_file=False).config
    assert (config.num_machines, config.machine_rank, config.main_process_ip) == (2, 1, "10.0.0.7")
    assert config.fsdp.sharding_strategy == "SHARD_GRAD_OP" and config.fsdp.cpu_offload

    answers = Answers({"strategy": "deepspeed", "deepspeed.zero_stage": ["4", "3"]})
    code, asked = run_wizard(monkeypatch, answers, "--config_file", str(target))
    assert code == 0 and asked.count("deepspeed.zero_stage") == 2
    assert not [name for name in asked if name.startswith("fsdp.")]
    config = resolve(env={}, config=target, use_default_file=False).config
    assert config.strategy == "deepspeed" and config.deepspeed.zero_stage == 3
    assert config.fsdp == Config().fsdp  # a skipped section is reset to its defaults


def test_wizard_edits_the_existing_default_file(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    default = nbaccel_default_file(os.environ)
    save(Config(num_processes=4, mixed_precision="fp16", project_dir="exp"), default)
    answers = Answers({"project_dir": "-", "gradient_accumulation_steps": "8"})
    code, _ = run_wizard(monkeypatch, answers)
    assert code == 0
    assert "num_processes [4]: " in answers.prompts
    assert "mixed_precision [fp16]: " in answers.prompts
    assert "project_dir [exp]: " in answers.prompts
    resolved = resolve(env=os.environ)
    assert resolved.config == Config(
        num_processes=4, mixed_precision="fp16", gradient_accumulation_steps=8
    )
    assert resolved.sources["num_processes"] == f"file:{default}"
    assert "--config_file" not in capsys.readouterr().out  # the default file needs no flag


def test_wizard_refuses_to_keep_a_value_that_conflicts_with_earlier_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "ds.yaml"
    save(Config(strategy="deepspeed"), target)
    # use_cpu=yes conflicts with the kept strategy 'deepspeed', which is asked after it
    answers = Answers({"use_cpu": "yes", "strategy": ["", "fsdp"]})
    code, asked = run_wizard(monkeypatch, answers, "--config_file", str(target))
    assert code == 0
    out = capsys.readouterr().out
    assert "strategy='deepspeed' needs CUDA GPUs" in out
    assert "press Enter to keep deepspeed" not in out  # Enter cannot keep it
    first = asked.index("strategy")
    assert asked[first + 1] == "strategy"
    config = resolve(env={}, config=target, use_default_file=False).config
    assert (config.use_cpu, config.strategy) == (True, "fsdp")


def test_wizard_reasks_from_the_field_a_final_cross_field_error_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A rule naming an earlier field (none in the schema yet) re-walks from that field."""
    schema_rules = nbaccel.config.schema.check_consistency

    def stricter(config: Config) -> None:
        schema_rules(config)
        if config.mixed_precision == "fp16" and config.log_ranks == "all":
            raise ConfigError("fp16 with log_ranks='all' (test rule).", field="mixed_precision")

    monkeypatch.setattr(nbaccel.config.schema, "check_consistency", stricter)
    target = tmp_path / "rule.yaml"
    answers = Answers({"mixed_precision": ["fp16", "bf16"], "log_ranks": "all"})
    code, asked = run_wizard(monkeypatch, answers, "--config_file", str(target))
    assert code == 0
    assert "! fp16 with log_ranks='all' (test rule)." in capsys.readouterr().out
    first = asked.index("mixed_precision")
    again = asked.index("mixed_precision", asked.index("log_ranks"))
    assert asked[again:] == asked[first:again]  # the same walk again, from that field
    config = resolve(env={}, config=target, use_default_file=False).config
    assert (config.mixed_precision, config.log_ranks) == ("bf16", "all")


def test_wizard_end_of_input_aborts_without_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "never.yaml"
    answers = Answers({"num_processes": "2"}, eof_at="mixed_precision")
    code, _ = run_wizard(monkeypatch, answers, "--config_file", str(target))
    assert code == 1
    assert not target.exists() and not list(tmp_path.glob("*.partial"))
    assert "nothing was written" in capsys.readouterr().err


def test_printed_launch_flags_parse_back_to_the_same_config() -> None:
    config = Config(
        num_processes=2,
        use_cpu=True,
        max_grad_norm=1.5,
        log_with=("csv",),
        project_dir="a b",
        strategy="fsdp",
        fsdp=Config().fsdp.__class__(cpu_offload=True),
        init_process_group=False,
    )
    flags = shlex.split(launch_flags(config))
    args = build_parser().parse_args(["config", "show", *flags])
    assert resolve(explicit_values(args), env={}).config == config


def help_text(argv: Iterable[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as stopped:
        main([*argv, "--help"])
    assert stopped.value.code == 0
    return capsys.readouterr().out


def test_help_for_every_command_comes_from_the_schema(capsys: pytest.CaptureFixture[str]) -> None:
    top = help_text([], capsys)
    assert "config" in top and "env" in top
    config = help_text(["config"], capsys)
    assert "--config_file" in config and "show" in config and "validate" in config
    assert all(opt.path in config for opt in options())  # the wizard's questions, in order
    show = help_text(["config", "show"], capsys)
    for opt in options():
        assert f"--{opt.name} " in show and opt.help.split(".")[0][:40] in show
    assert "--num-processes" in show and "--mixed-precision" in show
    assert "FILE" in help_text(["config", "validate"], capsys)
    assert "--json" in help_text(["env"], capsys)


def test_launch_help_names_flags_as_accelerate_users_expect(
    capsys: pytest.CaptureFixture[str],
) -> None:
    if importlib.util.find_spec("nbaccel.cli.launch") is None:
        pytest.skip("nbaccel launch is not built yet (nbaccel/cli/launch.py)")
    text = help_text(["launch"], capsys)
    for flag in ("--num_processes", "--num-processes", "--mixed_precision", "--config_file"):
        assert flag in text

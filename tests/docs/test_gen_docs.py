"""docs/config.md and docs/reasons.md are generated from the code (scripts/gen_docs.py) and must be current."""

from __future__ import annotations

from pathlib import Path

import pytest

from plugin import config as config_mod
from plugin.health.reasons import REASONS
from scripts import gen_docs


def test_generated_docs_are_current(capsys: pytest.CaptureFixture[str]) -> None:
    rc = gen_docs.main(["--check"])
    err = capsys.readouterr().err
    assert rc == 0, f"{err}\nThe config schema or the reason table changed: run `python scripts/gen_docs.py`."


def test_check_reports_a_stale_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    stale = tmp_path / "config.md"
    stale.write_text(gen_docs.render_config().replace("`GPU_HEALTH_POLL_INTERVAL`", "`GPU_HEALTH_POLL`"))
    fresh = tmp_path / "reasons.md"
    fresh.write_text(gen_docs.render_reasons())
    monkeypatch.setattr(gen_docs, "CONFIG_MD", stale)
    monkeypatch.setattr(gen_docs, "REASONS_MD", fresh)
    monkeypatch.setattr(gen_docs, "REPO", tmp_path)
    assert gen_docs.main(["--check"]) == 1
    assert "config.md is stale" in capsys.readouterr().err
    assert "GPU_HEALTH_POLL`" in stale.read_text(), "--check writes nothing"
    assert gen_docs.main([]) == 0
    assert gen_docs.main(["--check"]) == 0


def test_every_option_and_reason_is_documented() -> None:
    config_md = gen_docs.render_config()
    for o in config_mod.OPTIONS:
        row = next((ln for ln in config_md.splitlines() if ln.startswith(f"| `{o.flag}`")), None)
        assert row is not None, o.flag
        assert f"`{o.env}`" in row and f"`{o.leaf}`" in row
    reasons_md = gen_docs.render_reasons()
    for r in REASONS:
        assert f"| `{r.code}` | {r.severity.value} | `{r.action}` |" in reasons_md


def test_example_file_loads_to_the_defaults(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(gen_docs.example_file())
    loaded = config_mod.load({}, {}, path)
    assert loaded.effective() == config_mod.load({}, {}, None).effective()
    assert set(loaded.source.values()) <= {"file", "default"}
    # Every option the file can carry is in the example (unset ones as a comment).
    text = path.read_text()
    for o in config_mod.OPTIONS:
        assert f" {o.leaf}:" in text, o.leaf


def test_an_undescribed_health_key_stops_the_generator(monkeypatch: pytest.MonkeyPatch) -> None:
    keys = tuple(k for k in gen_docs.HEALTH_KEYS if k.path != "health.flap.backoffSeconds")
    monkeypatch.setattr(gen_docs, "HEALTH_KEYS", keys)
    with pytest.raises(gen_docs.DocsError, match=r"health\.flap\.backoffSeconds"):
        gen_docs.render_config()


def test_a_described_key_the_parser_rejects_stops_the_generator(monkeypatch: pytest.MonkeyPatch) -> None:
    extra = gen_docs.Key("sharing.timeSlicing.replicaz", "integer", "typo", None)
    monkeypatch.setattr(gen_docs, "SHARING_KEYS", (*gen_docs.SHARING_KEYS, extra))
    with pytest.raises(gen_docs.DocsError, match=r"replicaz"):
        gen_docs.render_config()


def test_health_defaults_in_the_docs_are_the_policy_defaults() -> None:
    # A documented default, fed back through the parser, gives the default policy.
    import yaml

    doc: dict[str, object] = {}
    h = gen_docs.HealthConfig()
    for k in gen_docs.HEALTH_KEYS:
        *parents, leaf = k.path.split(".")[1:]
        node = doc
        for p in parents:
            node = node.setdefault(p, {})  # type: ignore[assignment]
        node[leaf] = yaml.safe_load(gen_docs._fmt(k.default(h)))  # type: ignore[index]
    assert config_mod.parse_health(doc) == config_mod.parse_health(None)


def test_the_nvsentinel_mapping_has_a_row_per_reason_and_needs_its_markers(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    table = [ln for ln in gen_docs.render_nvsentinel_mapping().splitlines() if ln.startswith("| `")]
    assert [ln.split("`")[1] for ln in table] == [r.code for r in REASONS]
    page = tmp_path / "nvsentinel.md"
    page.write_text("# NVSentinel\n\nno markers here\n")
    monkeypatch.setattr(gen_docs, "NVSENTINEL_MD", page)
    with pytest.raises(gen_docs.DocsError, match="lacks the markers"):
        gen_docs.render_nvsentinel()

"""The Transformer Engine target of Plan.export: the YAML loads through nvdlfw-inspect's own
``debug_api.initialize`` and config parser, every layer gets exactly the section it should, and each
feature's keys and values pass the checks Transformer Engine applies when a layer calls it.

TE's feature classes import its CUDA extension, so they cannot load here; the stand-ins below
register TE's feature names in TE's namespace (what nvdlfw-inspect checks when it loads a file)
and apply, on each section, the key and value checks of TE's own classes (transcribed from
``transformer_engine/debug/features``: fake_quant.py, disable_quantization_gemm.py,
log_tensor_stats.py, log_nvfp4_tensor_stats.py; TE 2.x)."""
from __future__ import annotations

import re
import warnings

import pytest
import torch

nvdlfw = pytest.importorskip("nvdlfw_inspect")
import gradstats  # noqa: E402
from gradstats.plan.export.transformer_engine import layer_regex  # noqa: E402

STANDINS = '''
from nvdlfw_inspect.base import BaseConfigAPIMapper, BaseNamespaceAPI
from nvdlfw_inspect.registry import Registry, api_method


@Registry.register_namespace_api(namespace="transformer_engine")
class TransformerEngineAPI(BaseNamespaceAPI):
    def input_assertions_hook(self, api_name, **kwargs):
        pass

    def routing_condition(self, api_name, config, layer_name, feature_obj, **kwargs):
        return True, config

    def output_assertions_hook(self, api_name, ret, **kwargs):
        pass

    def is_multiple_feature_invocation_allowed(self, api_name):
        return False


class _GemmMapper(BaseConfigAPIMapper):
    """TE's TEConfigAPIMapper: gemms (fprop/dgrad/wgrad), and tensors through nvdlfw's own parsing."""

    def parse_config_and_api(self, config, gemm=None, tensor_name=None, **kwargs):
        config = dict(config)
        config.pop("enabled")
        if "gemms" not in config:
            raise ValueError("Provide 'gemms_struct: List[Dict]' or 'gemms: List[str]'")
        for g in config["gemms"]:
            assert g in ["fprop", "wgrad", "dgrad"], g
        if gemm not in config.pop("gemms"):
            return False, None
        config["gemm"] = gemm
        if tensor_name is not None:
            config = self._process_tensor_config(config, tensor_name)
        return config is not None, config


@Registry.register_feature(namespace="transformer_engine")
class FakeQuant(_GemmMapper):
    @api_method
    def modify_tensor_enabled(self, config, layer_name, gemm, tensor_name, **kwargs):
        for key in config:
            if key not in ["gemm", "tensor", "quant_format"]:
                raise ValueError(f"Unexpected key in config: {key}")
        assert config["quant_format"] in ["FP8E4M3", "FP8E5M2", "MXFP8E4M3", "MXFP8E5M2"]
        return True


@Registry.register_feature(namespace="transformer_engine")
class DisableQuantizationGEMM(_GemmMapper):
    @api_method
    def fp8_gemm_enabled(self, config, layer_name, gemm, **kwargs):
        for key in config:
            if key != "gemm":
                raise ValueError(f"Unexpected key in config: {key}")
        return False


@Registry.register_feature(namespace="transformer_engine")
class LogTensorStats(BaseConfigAPIMapper):
    SUPPORTED = {"min", "max", "mean", "std", "l1_norm", "l2_norm", "cur_amax", "dynamic_range"}

    def parse_config_and_api(self, config, tensor_name=None, **kwargs):
        config = self._process_tensor_config(dict(config), tensor_name)
        return config is not None, config

    @api_method
    def inspect_tensor_enabled(self, config, layer_name, tensor_name, **kwargs):
        for stat in config["stats"]:
            if isinstance(stat, dict):
                (name, args), = stat.items()
                assert name == "max_blockwise_dynamic_range" and set(args) <= {"block_size", "dims"}
                assert args["block_size"] > 0 and args["dims"] in (1, 2)
            else:
                assert stat in self.SUPPORTED, stat
        assert int(config.get("freq", 1)) >= 1
        return True


@Registry.register_feature(namespace="transformer_engine")
class LogNvfp4TensorStats(BaseConfigAPIMapper):
    """TE's check_if_stat_is_supported: underflows% and mse only."""

    def parse_config_and_api(self, config, tensor_name=None, **kwargs):
        config = self._process_tensor_config(dict(config), tensor_name)
        return config is not None, config

    @api_method
    def inspect_tensor_enabled(self, config, layer_name, tensor_name, **kwargs):
        for stat in config["stats"]:
            if stat not in ["underflows%", "mse"]:
                raise ValueError(f"Stat {stat} is not supported for NVFP4")
        assert int(config.get("freq", 1)) >= 1
        return True
'''


@pytest.fixture
def debug_api(tmp_path):
    """nvdlfw-inspect's API with the stand-ins' directory as TE's feature_dirs; reset after."""
    import nvdlfw_inspect.api as api

    features = tmp_path / "te_features"
    features.mkdir()
    (features / "te_standins.py").write_text(STANDINS)
    yield api, str(features)
    api.end_debug()


def _load(api, features, path, log_dir):
    api.initialize(config_file=str(path), feature_dirs=[features], log_dir=str(log_dir))
    from nvdlfw_inspect.config_manager import ConfigManager
    from nvdlfw_inspect.registry import Registry

    return ConfigManager, Registry.data["transformer_engine"].features


def _check_section(features, layer, section):
    """What TE's features do with a layer's section when the layer calls them."""
    te = section["transformer_engine"]
    for name, cfg in te.items():
        feat = features[name]
        if name == "FakeQuant":
            for g in ("dgrad", "wgrad"):
                ok, c = feat.parse_config_and_api(cfg, gemm=g, tensor_name="gradient")
                assert ok and feat.modify_tensor_enabled(c, layer, g, "gradient")
            assert not feat.parse_config_and_api(cfg, gemm="fprop", tensor_name="gradient")[0]
        elif name == "DisableQuantizationGEMM":
            for g in ("dgrad", "wgrad"):
                ok, c = feat.parse_config_and_api(cfg, gemm=g)
                assert ok and feat.fp8_gemm_enabled(c, layer, g) is False
        else:
            ok, c = feat.parse_config_and_api(cfg, tensor_name="gradient")
            assert ok and feat.inspect_tensor_enabled(c, layer, "gradient")


def _transformer():
    from gradstats.zoo.training import prepare

    return prepare("transformer", seed=0, d_model=32, n_layers=2).model


@pytest.mark.parametrize("fmt, block, quant", [("e5m2", None, "FP8E5M2"), ("e4m3fn", 32, "MXFP8E4M3")])
def test_te_config_loads_in_nvdlfw_inspect_and_means_the_plan(tmp_path, debug_api, fmt, block, quant):
    api, features = debug_api
    model = _transformer()
    plan = gradstats.Plan.uniform(format=fmt if block is None else f"{fmt}:block={block}", scale="amax")
    path = tmp_path / "te.yaml"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)        # the amax note (TE's scale is not a power of two)
        doc = plan.export("te", model, path=path)
    assert path.read_text().startswith("# Transformer Engine debug config")
    cm, te = _load(api, features, path, tmp_path / "logs")
    planned = set(plan.resolve(model))
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear):
            continue
        for prefix in ("", "model."):                       # a wrapper's prefix still matches
            cfg = cm.get_config_for_layer(prefix + name)
            sec = cfg.get("transformer_engine", {})
            if name in planned:
                assert sec["FakeQuant"]["quant_format"] == quant
                assert sec["FakeQuant"]["tensors"] == ["gradient"]
            else:                                           # the output layer: gradient GEMMs in high precision
                assert name == plan.output_layer_of(model) == "head"
                assert sec["DisableQuantizationGEMM"]["gemms"] == ["dgrad", "wgrad"]
            _check_section(te, prefix + name, {"transformer_engine": sec})
            stats = sec["LogTensorStats"]["stats"]
            blockwise = {"max_blockwise_dynamic_range": {"block_size": 32, "dims": 1}} in stats
            assert blockwise == (block is not None and name in planned)
    assert cm.get_config_for_layer("tok_emb") == {}         # not a layer of the plan
    assert len(doc["config"]) == len(planned) + 1 and not doc["skipped"]


def test_recommended_plan_exports_to_te_with_what_te_cannot_express(tmp_path, debug_api):
    """A recommended 8-bit plan of a traced transformer, and one of 6 bits: the FP6 layers are
    skipped with the reason, the notes listed once, and ``strict`` refuses."""
    api, features = debug_api
    model = _transformer()
    run_dir = tmp_path / "run"
    with gradstats.trace(model, run_dir) as t:
        for _ in range(2):
            x = torch.randint(0, 65, (2, 16))
            model(x).logsumexp(-1).mean().backward()
            t.step()
    plan8 = gradstats.recommend(run_dir, bits=8)
    with pytest.warns(UserWarning, match="not expressible"):
        doc = plan8.export("te", model, path=tmp_path / "te8.yaml")
    assert not doc["skipped"]
    fmts = {sec["transformer_engine"].get("FakeQuant", {}).get("quant_format") for sec in doc["config"].values()}
    assert fmts - {None} <= {"FP8E4M3", "FP8E5M2"} and fmts - {None}
    cm, te = _load(api, features, tmp_path / "te8.yaml", tmp_path / "logs8")
    for name in plan8.resolve(model):
        _check_section(te, name, cm.get_config_for_layer(name))
    plan6 = gradstats.recommend(run_dir, bits=6, noise_bound=None)     # FP6 on every layer (unbounded)
    with pytest.warns(UserWarning, match="FakeQuant has FP8E4M3"):
        doc6 = plan6.export("te", model)
    assert set(doc6["skipped"]) == set(plan6.resolve(model))
    assert [s["transformer_engine"] for s in doc6["config"].values()][0]["DisableQuantizationGEMM"]
    with pytest.raises(ValueError, match="not expressible"):
        plan6.export("te", model, strict=True)


def test_te_export_without_a_model_and_on_the_cli(tmp_path, capsys):
    from gradstats.cli import main

    plan = gradstats.Plan([gradstats.PlanEntry("blocks.0.fc1", format="e4m3fn", scale="amax")])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        doc = plan.export("transformer_engine")
    (sec,) = doc["config"].values()
    assert sec["layers"]["layer_name_regex_pattern"] == layer_regex("blocks.0.fc1")
    assert re.search(layer_regex("blocks.0.fc1"), "blocks.0.fc1") and not re.search(layer_regex("blocks.0.fc1"), "blocks.0.fc10")
    plan.save(tmp_path / "plan.json")
    assert main(["export", str(tmp_path / "plan.json"), "--to", "te"]) == 0
    out = capsys.readouterr().out
    assert "quant_format: FP8E4M3" in out and "note:" in out
    assert main(["export", str(tmp_path / "plan.json"), "--to", "te", "-o", str(tmp_path / "x.yaml")]) == 0
    import yaml

    assert yaml.safe_load((tmp_path / "x.yaml").read_text()) == doc["config"]


def test_an_nvfp4_training_plan_loads_with_nvfp4_and_high_precision_layers(tmp_path, debug_api):
    """The "nvfp4_training" plan on the transformer: its planned layers get LogNvfp4TensorStats (TE's
    NVFP4 recipe quantises them), a layer the plan keeps in full precision and the output layer get
    DisableQuantizationGEMM; the header names the recipe's settings."""
    api, features = debug_api
    model = _transformer()
    planned = gradstats.Plan.uniform(format="nvfp4_training")
    keep = sorted(planned.resolve(model))[0]
    plan = planned.with_entries(gradstats.PlanEntry(keep, format=None))
    path = tmp_path / "te.yaml"
    with pytest.warns(UserWarning, match="also quantises the layer's forward input"):
        doc = plan.export("te", model, path=path)
    text = path.read_text()
    assert "NVFP4BlockScaling(disable_rht=False, disable_stochastic_rounding=False)" in text
    cm, te = _load(api, features, path, tmp_path / "logs")
    nvfp4 = set(planned.resolve(model)) - {keep}
    assert nvfp4
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear):
            continue
        sec = cm.get_config_for_layer(name).get("transformer_engine", {})
        if name in nvfp4:
            assert sec["LogNvfp4TensorStats"]["stats"] == ["underflows%", "mse"] and "FakeQuant" not in sec
            assert "DisableQuantizationGEMM" not in sec
        else:
            assert name in (keep, planned.output_layer_of(model))
            assert sec["DisableQuantizationGEMM"]["gemms"] == ["dgrad", "wgrad"]
        _check_section(te, name, {"transformer_engine": sec})
    assert doc["recipe"]["recipe"] == "NVFP4BlockScaling" and not doc["skipped"]

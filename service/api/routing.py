"""Which served model a request goes to: by its `model`, or a translator by its languages; without
either, the first model of the route's kind (ServiceConfig.models' order). Unknown names and
pairs are 4xx errors that say what is served."""

from loading.folder import ModelKind
from service.api.errors import APIError
from service.api.language_id import LANGUAGE_NAMES, NOT_SOURCE_CONFIDENCE, detect_languages
from service.config import ModelServingConfig, ServiceConfig

ELSEWHERE = {"translator": "translation is served at /v1/translate", "generator": "completions are served at /v1/completions"}


def model_by_name(config: ServiceConfig, kind: ModelKind, name: str | None) -> ModelServingConfig:
    """The model of this kind named `name`, or the first of the kind when None; 404 otherwise."""
    if name is None:
        models = config.models_of(kind)
        if not models:
            raise APIError(404, f"no {kind} is served here", "model")
        return models[0]
    model = config.model_named(name)
    if model is None:
        served = ", ".join(m.name for m in config.models_of(kind))
        raise APIError(404, f"The model `{name}` does not exist (served {kind}s: {served or 'none'}).", "model")
    if model.kind != kind:
        raise APIError(404, f"The model `{name}` is a {model.kind}; {ELSEWHERE[model.kind]}.", "model")
    return model


def model_of_any_kind(config: ServiceConfig, name: str | None) -> ModelServingConfig:
    """The model named `name` whatever its kind, or when None the first generator (else the first
    model); 404 for a name not served."""
    if name is None:
        return (config.models_of("generator") or list(config.models))[0]
    model = config.model_named(name)
    if model is None:
        raise APIError(404, f"The model `{name}` does not exist (served: {', '.join(m.name for m in config.models)}).", "model")
    return model


def pairs(config: ServiceConfig) -> list[tuple[str, str]]:
    """The language pairs served, in the models' order, each once."""
    seen: dict[tuple[str, str], None] = {}
    for m in config.models_of("translator"):
        assert m.source_lang is not None and m.target_lang is not None  # a translator's entry has both
        seen.setdefault((m.source_lang, m.target_lang))
    return list(seen)


def language_name(code: str) -> str:
    return LANGUAGE_NAMES.get(code, code)


def detect_source(text: str, sources: list[str], param: str) -> str:
    """The source language of text among `sources` (source "auto"). Text confidently in a language
    no translator reads is a 400 naming it; otherwise the most probable of `sources`."""
    ranked = detect_languages(text, top=len(LANGUAGE_NAMES))
    best = ranked[0]
    if best.language in sources:
        return best.language
    if best.confidence >= NOT_SOURCE_CONFIDENCE:
        served = ", ".join(f"{language_name(s)} ({s})" for s in sources)
        raise APIError(
            400,
            f"the text looks {language_name(best.language)} ({best.language}, confidence {best.confidence:.0%}); this server "
            f"translates from {served} (send the source language to translate it anyway)",
            param,
        )
    return next(d.language for d in ranked if d.language in sources)


def translator_for(
    config: ServiceConfig, name: str | None, source: str | None, target: str | None, detect_text: str, params: tuple[str, str]
) -> tuple[ModelServingConfig, str | None]:
    """The translator a request goes to, and the source language detected when source is "auto"
    (else None). By name when given (its languages must then agree with source and target, if
    sent); else by the pair, a missing side taken from the first translator that fits the other.
    params: the request's names of the source and target fields, for errors."""
    if name is not None:
        model = model_by_name(config, "translator", name)
        for sent, served, param in [(source, model.source_lang, params[0]), (target, model.target_lang, params[1])]:
            if sent not in (None, "auto", served):
                raise APIError(400, f"the model `{name}` translates {model.source_lang} -> {model.target_lang}, not {sent}", param)
        detected = detect_source(detect_text, [model.source_lang or ""], params[0]) if source == "auto" else None
        return model, detected
    translators = config.models_of("translator")
    if not translators:
        raise APIError(404, "no translator is served here", "model")
    fitting_target = [m for m in translators if target is None or m.target_lang == target]
    detected = None
    if source == "auto":
        sources = list(dict.fromkeys(m.source_lang or "" for m in fitting_target)) or [translators[0].source_lang or ""]
        source = detected = detect_source(detect_text, sources, params[0])
    chosen = next((m for m in fitting_target if source is None or m.source_lang == source), None)
    if chosen is None:
        served = ", ".join(f"{s} -> {t}" for s, t in pairs(config))
        raise APIError(400, f"{source or '*'} -> {target or '*'} is not supported; this server translates {served}", params[1])
    return chosen, detected

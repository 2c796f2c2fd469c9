//! Resolving a request's model to its candidates (part of the prepare phase): the allow-list,
//! the backends that speak the request's API natively or by translation, the one holder of a
//! pinned request, and only backends that keep state for a request that needs it.
//!
//! Invariants: a model is known when a configured or discovered backend serves it (healthy or
//! not); a refusal says why nothing serves the request (the field, the translation, the
//! holder), never just "not found" when the model exists.

use crate::api::translate::Translation;
use crate::api::{ClientApi, Pin};
use crate::auth::Identity;
use crate::fleet::Resolved;
use crate::gateway::Runtime;
use crate::openai::{ApiError, RequestFields};

/// The allow-list, then the model's candidates among the backends that speak `api`, natively or
/// by translation (only the holder of a pinned request). Both are candidates, so failover
/// crosses them; a native one is preferred when one can take the request ([`pick_native`]), and
/// each backend is sent the request natively when it speaks the API.
pub(super) fn resolve(
    rt: &Runtime,
    api: &dyn ClientApi,
    identity: &Identity,
    fields: &RequestFields,
    pin: Option<&Pin>,
    translation: Option<&Result<Translation, ApiError>>,
) -> Result<Resolved, ApiError> {
    if !identity.allows(&rt.fleet, &fields.model) {
        return Err(crate::auth::model_refused(
            &fields.model,
            rt.config.hide_disallowed_models,
        ));
    }
    let mut resolved = rt
        .fleet
        .resolve(&fields.model)
        .ok_or_else(|| ApiError::model_not_found(&fields.model))?;
    let by_translation =
        |kind| !api.native(kind) && api.translator().is_some_and(|t| t.serves(kind));
    let translated = matches!(translation, Some(Ok(_)));
    let servable = |kind| api.native(kind) || (translated && by_translation(kind));
    if !resolved.candidates.iter().any(|(b, _)| servable(b.kind())) {
        // Only translation could serve it, and the request does not translate: say why.
        if let Some(Err(refused)) = translation {
            if resolved
                .candidates
                .iter()
                .any(|(b, _)| by_translation(b.kind()))
            {
                return Err(refused.clone());
            }
        }
        let kinds: Vec<_> = resolved.candidates.iter().map(|(b, _)| b.kind()).collect();
        return Err(api.unserved(&fields.model, &kinds));
    }
    resolved.candidates.retain(|(b, _)| servable(b.kind()));
    if let Some(pin) = pin {
        resolved.candidates.retain(|(b, _)| pin.holds(b.name()));
        if resolved.candidates.is_empty() {
            let holder = rt.fleet.backends().iter().find(|b| pin.holds(b.name()));
            return Err(match holder {
                Some(b) => pin.model_not_there(b.name(), &fields.model),
                None => pin.gone(),
            });
        }
    }
    Ok(resolved)
}

/// A request that needs state kept by its backend (a stored or background response) goes
/// only to backends that keep it; `Err` when the model has none, or when the pinned holder is
/// one that keeps nothing.
pub(super) fn keep_state(
    rt: &Runtime,
    api: &dyn ClientApi,
    body: &[u8],
    fields: &RequestFields,
    pin: Option<&Pin>,
    mut resolved: Resolved,
) -> Result<Resolved, ApiError> {
    let Some(field) = api.needs_state(body) else {
        return Ok(resolved);
    };
    let kinds: Vec<_> = resolved.candidates.iter().map(|(b, _)| b.kind()).collect();
    resolved
        .candidates
        .retain(|(b, _)| api.keeps_state(b.kind()));
    if !resolved.candidates.is_empty() {
        return Ok(resolved);
    }
    let holder = pin.and_then(|p| {
        rt.fleet
            .backends()
            .iter()
            .find(|b| p.holds(b.name()))
            .map(|b| (p, b))
    });
    Err(match holder {
        Some((pin, b)) => pin.not_stored(b.name()),
        None => api.stateless(&fields.model, field, &kinds),
    })
}

/// The request translated for the backends that serve its API only by translation, when the
/// model has any (a model served only natively pays nothing for it).
pub(super) fn translate_if_served(
    rt: &Runtime,
    api: &dyn ClientApi,
    fields: &RequestFields,
    body: &[u8],
) -> Option<Result<Translation, ApiError>> {
    let translator = api.translator()?;
    let resolved = rt.fleet.resolve(&fields.model)?;
    let needed = resolved
        .candidates
        .iter()
        .any(|(b, _)| !api.native(b.kind()) && translator.serves(b.kind()));
    needed.then(|| translator.request(body, api.streams(fields)))
}

/// The translation's refusal when the model exists and none of its backends speaks `api`
/// natively.
pub(super) fn refused_translation(
    rt: &Runtime,
    api: &dyn ClientApi,
    fields: &RequestFields,
    translation: Option<Result<Translation, ApiError>>,
) -> Option<ApiError> {
    let refused = translation?.err()?;
    let resolved = rt.fleet.resolve(&fields.model)?;
    let native = resolved
        .candidates
        .iter()
        .any(|(b, _)| api.native(b.kind()));
    (!native).then_some(refused)
}

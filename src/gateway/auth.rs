//! Who is asking: the bearer key, looked up by its SHA-256 in the store on
//! every request (a revoked key is refused from the next request on), and
//! the models (profiles) it may use. A key's tenant may use a profile its
//! `tenants` allow; the key may narrow that to its own list. A profile of
//! another tenant is answered as unknown (404), so a key learns nothing
//! of other tenants' profiles; one of its tenant's the key may not use is
//! forbidden (403).

use axum::http::HeaderMap;
use toolfleet_config::FleetConfig;
use toolfleet_store::CitationStore;
use toolfleet_store::api_keys::ApiKeyRecord;

use super::error::ApiError;

/// The key of the request's `Authorization: Bearer` header.
///
/// # Errors
///
/// 401 without a key, with one of the wrong shape or one the store does
/// not know; 503 when the store cannot be asked.
pub(crate) async fn authenticate(
    store: &CitationStore,
    headers: &HeaderMap,
) -> Result<ApiKeyRecord, ApiError> {
    let Some(value) = headers.get(axum::http::header::AUTHORIZATION) else {
        return Err(ApiError::invalid_key(true));
    };
    let key = value
        .to_str()
        .ok()
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, key)| key.trim())
        .filter(|key| crate::keys::looks_like_key(key))
        .ok_or_else(|| ApiError::invalid_key(false))?;
    match store.api_key(&crate::keys::sha256_hex(key)).await {
        Ok(Some(record)) => Ok(record),
        Ok(None) => Err(ApiError::invalid_key(false)),
        Err(e) => {
            tracing::warn!(error = %e, "the key store cannot be read");
            Err(ApiError::unavailable(
                "The gateway cannot check API keys now; try again shortly.",
            ))
        }
    }
}

/// Whether the key may run `model`.
///
/// # Errors
///
/// 404 for a profile that does not exist or that the key's tenant may not
/// use; 403 for one of its tenant's that the key may not use.
pub(crate) fn check_model(
    profiles: &FleetConfig,
    key: &ApiKeyRecord,
    model: &str,
) -> Result<(), ApiError> {
    match profiles.profiles.get(model) {
        Some(p) if p.tenants.allows(&key.tenant) => {
            if key.profiles.is_empty() || key.profiles.iter().any(|k| k == model) {
                Ok(())
            } else {
                Err(ApiError::model_not_allowed(model))
            }
        }
        _ => Err(ApiError::model_not_found(model)),
    }
}

/// The models the key may run, in name order.
pub(crate) fn models(profiles: &FleetConfig, key: &ApiKeyRecord) -> Vec<String> {
    profiles
        .profiles
        .keys()
        .filter(|name| check_model(profiles, key, name).is_ok())
        .cloned()
        .collect()
}

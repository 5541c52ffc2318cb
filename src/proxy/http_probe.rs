//! [`HttpProbe`]: the gate's probes over HTTP, against `vllm serve` with the `session_gate`
//! endpoint plugin (`POST /session_gate/v1/{usage,probe,forget}`).
//!
//! Prompts travel as packed little-endian `u32` token ids (`application/octet-stream`), which
//! the server hands to the engine core untouched. The last usage answer is kept, so the router
//! can compare replicas' headroom without probing again.
use std::sync::Mutex;

use bytes::Bytes;
use hyper::StatusCode;
use serde_json::Value;

use super::upstream::{Client, percent_encode, post_for_json};
use crate::error::{Error, Result};
use crate::gate::{PrefixReport, Probe, ProbeFuture, UsageReport};

/// Probes one `vllm serve` replica over HTTP.
pub struct HttpProbe {
    client: Client,
    base: String,
    authority: String,
    authorization: Option<String>,
    last_usage: Mutex<Option<UsageReport>>,
}

impl std::fmt::Debug for HttpProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpProbe")
            .field("base", &self.base)
            .finish_non_exhaustive()
    }
}

fn unavailable(what: impl std::fmt::Display) -> Error {
    Error::ProbeUnavailable(what.to_string())
}

fn u64_field(v: &Value, key: &str) -> Result<u64> {
    v.get(key)
        .and_then(Value::as_u64)
        .ok_or_else(|| unavailable(format!("answer has no integer {key:?}")))
}

fn f64_field(v: &Value, key: &str) -> Result<f64> {
    v.get(key)
        .and_then(Value::as_f64)
        .ok_or_else(|| unavailable(format!("answer has no number {key:?}")))
}

/// What the engine answers for a host-tier figure it cannot read.
const TIER_UNAVAILABLE: &str = "unavailable";

/// A host-tier field (`offloaded_tokens`, `offload_num_blocks`, `offload_used_blocks`): an
/// integer, or `"unavailable"` (no readable tier); absent or `null` (an engine that predates
/// the tier) reads as unavailable too. Anything else is a bad answer.
/// A count an older plugin does not report: absent or `null` = `None`.
fn optional_u64(v: &Value, key: &str) -> Result<Option<u64>> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(_) => u64_field(v, key).map(Some),
    }
}

fn tier_field(v: &Value, key: &str) -> Result<Option<u64>> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s == TIER_UNAVAILABLE => Ok(None),
        Some(_) => u64_field(v, key).map(Some),
    }
}

impl HttpProbe {
    /// A probe of the replica at `base` (`http://host:port`) whose `host:port` is `authority`.
    /// `authorization` is sent as the `Authorization` header (a replica run with `--api-key`).
    pub fn new(client: Client, base: &str, authority: &str, authorization: Option<&str>) -> Self {
        Self {
            client,
            base: base.trim_end_matches('/').to_string(),
            authority: authority.to_string(),
            authorization: authorization.map(str::to_string),
            last_usage: Mutex::new(None),
        }
    }

    /// The last usage answer, if any arrived.
    pub fn last_usage(&self) -> Option<UsageReport> {
        *self.last_usage.lock().unwrap_or_else(|e| e.into_inner())
    }

    async fn post(&self, path_and_query: &str, content_type: &str, body: Bytes) -> Result<Value> {
        let (status, value) = post_for_json(
            &self.client,
            &self.base,
            &self.authority,
            self.authorization.as_deref(),
            path_and_query,
            content_type,
            body,
        )
        .await
        .map_err(unavailable)?;
        if status != StatusCode::OK {
            let message = value
                .pointer("/error/message")
                .and_then(Value::as_str)
                .unwrap_or("no message");
            return Err(unavailable(format!(
                "{}{path_and_query} answered {status}: {message}",
                self.base
            )));
        }
        Ok(value)
    }

    async fn usage_impl(&self) -> Result<UsageReport> {
        let v = self
            .post("/session_gate/v1/usage", "application/json", Bytes::new())
            .await?;
        let report = UsageReport {
            kv_cache_usage: f64_field(&v, "kv_cache_usage")?,
            num_blocks: u64_field(&v, "num_blocks")?,
            num_free_blocks: u64_field(&v, "num_free_blocks")?,
            // `null` (or absent) unless the count was asked for; a number must be a valid one.
            num_cached_free_blocks: match v.get("num_cached_free_blocks") {
                None | Some(Value::Null) => None,
                Some(_) => Some(u64_field(&v, "num_cached_free_blocks")?),
            },
            block_size: u64_field(&v, "block_size")?,
            offload_num_blocks: tier_field(&v, "offload_num_blocks")?,
            offload_used_blocks: tier_field(&v, "offload_used_blocks")?,
            num_running_reqs: optional_u64(&v, "num_running_reqs")?,
            num_waiting_reqs: optional_u64(&v, "num_waiting_reqs")?,
        };
        *self.last_usage.lock().unwrap_or_else(|e| e.into_inner()) = Some(report);
        Ok(report)
    }

    async fn prefix_impl(&self, session_id: &str, prompt_ids: &[u32]) -> Result<PrefixReport> {
        let mut packed = Vec::with_capacity(prompt_ids.len() * 4);
        for t in prompt_ids {
            packed.extend_from_slice(&t.to_le_bytes());
        }
        let path = format!(
            "/session_gate/v1/probe?session_id={}",
            percent_encode(session_id)
        );
        let v = self
            .post(&path, "application/octet-stream", Bytes::from(packed))
            .await?;
        if v.get("available").and_then(Value::as_bool) == Some(false) {
            let reason = v
                .get("reason")
                .and_then(Value::as_str)
                .unwrap_or("prefix probe answered unavailable");
            return Err(unavailable(reason));
        }
        Ok(PrefixReport {
            hit_ratio: f64_field(&v, "hit_ratio")?,
            hit_blocks: u64_field(&v, "hit_blocks")?,
            hit_tokens: u64_field(&v, "hit_tokens")?,
            prompt_tokens: u64_field(&v, "prompt_tokens")?,
            offloaded_tokens: tier_field(&v, "offloaded_tokens")?,
        })
    }

    async fn forget_impl(&self, session_id: &str) -> Result<()> {
        let body = serde_json::to_vec(&serde_json::json!({ "session_id": session_id }))
            .map_err(|e| unavailable(e.to_string()))?;
        self.post(
            "/session_gate/v1/forget",
            "application/json",
            Bytes::from(body),
        )
        .await
        .map(|_| ())
    }
}

impl Probe for HttpProbe {
    fn usage(&self) -> ProbeFuture<'_, UsageReport> {
        Box::pin(self.usage_impl())
    }

    fn prefix<'a>(
        &'a self,
        session_id: &'a str,
        prompt_ids: &'a [u32],
    ) -> ProbeFuture<'a, PrefixReport> {
        Box::pin(self.prefix_impl(session_id, prompt_ids))
    }

    fn forget<'a>(&'a self, session_id: &'a str) -> ProbeFuture<'a, ()> {
        Box::pin(self.forget_impl(session_id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn host_tier_fields_read_ints_and_unavailable_and_old_answers() {
        let v = json!({"offloaded_tokens": 4096, "offload_num_blocks": "unavailable",
                       "offload_used_blocks": null});
        assert_eq!(tier_field(&v, "offloaded_tokens").unwrap(), Some(4096));
        assert_eq!(tier_field(&v, "offload_num_blocks").unwrap(), None);
        assert_eq!(tier_field(&v, "offload_used_blocks").unwrap(), None);
        // An engine that predates the tier sends no key at all.
        assert_eq!(tier_field(&json!({}), "offloaded_tokens").unwrap(), None);
        for bad in [
            json!({"offloaded_tokens": "lots"}),
            json!({"offloaded_tokens": -1}),
        ] {
            let err = tier_field(&bad, "offloaded_tokens")
                .unwrap_err()
                .to_string();
            assert!(err.contains("offloaded_tokens"), "{err}");
        }
    }
}

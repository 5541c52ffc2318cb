//! Discovery: the replicas that come and go while the proxy runs, from a replicas file
//! ([`super::replicas_file`]) and DNS names ([`super::replicas_dns`]), polled every [`POLL`].
//!
//! Each source keeps its last good answer: a file that cannot be read or has a bad line, or a
//! name that does not resolve, is logged once (until its answer changes) and leaves that
//! source's replicas as they were. The listed replicas are the static ones (flags, TOML
//! `replicas`) and the union of the sources' last good answers, applied through
//! [`Replicas::set_listed`] only when that union changed: a replica added takes new sessions,
//! one gone takes none and its sessions move at their next turn.
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use super::config::ReplicaUrl;
use super::replicas::Replicas;
use super::replicas_dns::{self, DnsName};
use super::replicas_file;

/// How often the file is looked at and the names resolved again.
pub const POLL: Duration = Duration::from_secs(2);

/// What the sources answered last.
#[derive(Debug, Clone, Default)]
pub struct Sources {
    /// The replicas file: its path, its last text read (valid or not) and its last good list.
    pub file: Option<(PathBuf, String, Vec<ReplicaUrl>)>,
    /// Each DNS name, its last error (reported once) and its last good list.
    pub dns: Vec<(DnsName, Option<String>, Vec<ReplicaUrl>)>,
}

impl Sources {
    /// Whether there is anything to poll.
    pub fn is_empty(&self) -> bool {
        self.file.is_none() && self.dns.is_empty()
    }

    /// The union of the sources' last good lists, in source order, each URL once.
    pub fn listed(&self) -> Vec<ReplicaUrl> {
        let mut out: Vec<ReplicaUrl> = Vec::new();
        let file = self.file.iter().flat_map(|(_, _, urls)| urls);
        for url in file.chain(self.dns.iter().flat_map(|(_, _, urls)| urls)) {
            if !out.iter().any(|u| u.base == url.base) {
                out.push(url.clone());
            }
        }
        out
    }

    /// Looks at every source once, keeping each one's last good answer.
    pub async fn poll(&mut self) {
        if let Some((path, last_text, urls)) = &mut self.file {
            match std::fs::read_to_string(&*path) {
                Ok(text) if text != *last_text => {
                    match replicas_file::parse(path, &text) {
                        Ok(new) => *urls = new,
                        Err(e) => eprintln!(
                            "session-gate proxy: the replicas file changed but is not valid \
                             ({e}); keeping the last good list"
                        ),
                    }
                    // A bad version is reported once, not every poll, until the file changes.
                    *last_text = text;
                }
                Ok(_) => {}
                Err(e) => eprintln!(
                    "session-gate proxy: cannot re-read the replicas file {} ({e}); keeping the \
                     last good list",
                    path.display()
                ),
            }
        }
        for (name, last_error, urls) in &mut self.dns {
            match replicas_dns::resolve(name).await {
                Ok(new) => {
                    *urls = new;
                    *last_error = None;
                }
                Err(e) => {
                    if last_error.as_deref() != Some(e.as_str()) {
                        eprintln!("session-gate proxy: {e}; keeping the replicas it had");
                    }
                    *last_error = Some(e);
                }
            }
        }
    }
}

/// Polls `sources` every [`POLL`] and applies each change of their union to `replicas`,
/// forever. `sources` holds what the proxy started from.
pub async fn watch(replicas: Arc<Replicas>, mut sources: Sources) {
    let mut applied = sources.listed();
    loop {
        tokio::time::sleep(POLL).await;
        sources.poll().await;
        let listed = sources.listed();
        if listed != applied {
            replicas.set_listed(&listed);
            applied = listed;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::config::parse_replica;

    fn urls(list: &[&str]) -> Vec<ReplicaUrl> {
        list.iter()
            .map(|u| parse_replica("t", u).unwrap())
            .collect()
    }

    #[tokio::test]
    async fn each_source_keeps_its_last_good_answer_and_the_union_is_listed_once() {
        let dir = std::env::temp_dir().join(format!("sg-discovery-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("replicas.txt");
        std::fs::write(&path, "http://127.0.0.1:8001\n").unwrap();
        let mut sources = Sources {
            file: Some((path.clone(), String::new(), Vec::new())),
            dns: vec![
                (DnsName::parse("localhost:8001").unwrap(), None, Vec::new()),
                (
                    DnsName::parse("no-such-host.invalid:80").unwrap(),
                    None,
                    urls(&["http://10.0.0.9:80"]),
                ),
            ],
        };
        sources.poll().await;
        let listed: Vec<String> = sources.listed().into_iter().map(|u| u.base).collect();
        // The file's replica and localhost's are one; the name that no longer resolves keeps
        // the replica it had, and says why.
        assert_eq!(listed[0], "http://127.0.0.1:8001");
        assert!(
            listed.contains(&"http://10.0.0.9:80".to_string()),
            "{listed:?}"
        );
        assert_eq!(
            listed.iter().filter(|u| u.contains("127.0.0.1")).count(),
            1,
            "{listed:?}"
        );
        assert!(
            sources.dns[1]
                .1
                .as_deref()
                .unwrap()
                .contains("cannot resolve")
        );
        // A bad line keeps the file's last good list; a good one replaces it.
        std::fs::write(&path, "http://127.0.0.1:8001\nhtps://x\n").unwrap();
        sources.poll().await;
        assert_eq!(
            sources.file.as_ref().unwrap().2,
            urls(&["http://127.0.0.1:8001"])
        );
        std::fs::write(&path, "http://127.0.0.1:8002\n").unwrap();
        sources.poll().await;
        assert_eq!(
            sources.file.as_ref().unwrap().2,
            urls(&["http://127.0.0.1:8002"])
        );
        // A file that cannot be read keeps it too.
        std::fs::remove_file(&path).unwrap();
        sources.poll().await;
        assert_eq!(
            sources.file.as_ref().unwrap().2,
            urls(&["http://127.0.0.1:8002"])
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

//! `--replicas-file PATH`: the replicas listed in a file that may change while the proxy runs
//! (a Kubernetes headless service's endpoints written out by a sidecar, a Ray or Slurm job's
//! host list). One `http://host[:port]` a line; `#` starts a comment; blank lines are skipped.
//!
//! Read once at startup, where a bad line is a configuration error naming the line, then polled
//! every [`POLL`](super::discovery::POLL) by the discovery loop ([`super::discovery`]): when its text changed, it is
//! parsed again and the proxy's replica list updated. A re-read that fails (unreadable file, a
//! bad line) is logged and the last good list is kept: a half-written file must not empty the
//! fleet.
use std::path::Path;

use super::config::{ReplicaUrl, parse_replica};

/// Parses the file's text: one replica URL a line, `#` comments, blank lines skipped. An error
/// names the line (1-based) and what is wrong with it; a URL listed twice is an error too.
pub fn parse(path: &Path, text: &str) -> Result<Vec<ReplicaUrl>, String> {
    let mut urls: Vec<ReplicaUrl> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let content = line.split('#').next().unwrap_or_default().trim();
        if content.is_empty() {
            continue;
        }
        let field = format!("{} line {}", path.display(), i + 1);
        let url = parse_replica(&field, content).map_err(|e| format!("{field}: {}", e.message))?;
        if urls.iter().any(|u| u.base == url.base) {
            return Err(format!("{field}: {content:?} is listed twice"));
        }
        urls.push(url);
    }
    Ok(urls)
}

/// Reads and parses the file.
pub fn read(path: &Path) -> Result<(String, Vec<ReplicaUrl>), String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read the replicas file {}: {e}", path.display()))?;
    let urls = parse(path, &text)?;
    Ok((text, urls))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comments_and_blank_lines_are_skipped_and_urls_kept_in_order() {
        let text = "# the fleet\nhttp://a:1\n\n  http://b:2/  # second\n#http://c:3\n";
        let urls = parse(Path::new("f"), text).unwrap();
        let bases: Vec<_> = urls.iter().map(|u| u.base.as_str()).collect();
        assert_eq!(bases, ["http://a:1", "http://b:2"]);
        assert_eq!(urls[1].authority, "b:2");
    }

    #[test]
    fn a_bad_line_is_named_by_its_number() {
        let e = parse(Path::new("fleet.txt"), "http://a:1\n\nhtps://b:2\n").unwrap_err();
        assert!(e.contains("fleet.txt line 3"), "{e}");
        assert!(e.contains("must start with http://"), "{e}");
        let e = parse(Path::new("fleet.txt"), "http://a:1\nhttp://a:1/\n").unwrap_err();
        assert!(
            e.contains("fleet.txt line 2") && e.contains("listed twice"),
            "{e}"
        );
        let e = parse(Path::new("f"), "http://a:port\n").unwrap_err();
        assert!(e.contains("f line 1") && e.contains("invalid port"), "{e}");
    }
}

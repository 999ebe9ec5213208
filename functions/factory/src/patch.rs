//! The patch format of the fix model's answer.
//!
//! The model answers with the full new content of every file it changes, each introduced by a header line
//! `=== path/to/file` followed by a fenced block:
//!
//! ````text
//! === src/checkout.py
//! ```python
//! ...whole file...
//! ```
//! ````
//!
//! The opening fence is three or more backticks (an info string may follow); the block ends at the first line made of
//! exactly the same backticks, so a file that itself contains ``` lines is fenced with more backticks. Text outside
//! the blocks is ignored. Paths must be relative, without `..` components, and not inside `.git`. Beyond the format,
//! [`check_scope`] limits a patch to the files the organisation configured (`Config::target_files`) and never lets it
//! touch CI or repository automation, whose change would run code with the repository's credentials.

use serde::{Deserialize, Serialize};

use crate::{MAX_FILE_BYTES, MAX_FILES};

/// One file of a repository read or of a patch. `content: None` is a file that does not exist.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct FileContent {
    pub path: String,
    pub content: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PatchError {
    #[error(
        "the answer contains no file block (expected a line `=== path` followed by a fenced block)"
    )]
    NoFiles,
    #[error("file block for {0} is not followed by a fenced block")]
    MissingFence(String),
    #[error("file block for {0} is not closed")]
    Unclosed(String),
    #[error("path {0:?} is not a relative path inside the repository")]
    BadPath(String),
    #[error("file {0} appears twice")]
    Duplicate(String),
    #[error("file {0} is larger than {MAX_FILE_BYTES} bytes")]
    TooLarge(String),
    #[error("more than {MAX_FILES} files")]
    TooMany,
    #[error("path {path} may not be changed: {why}")]
    Disallowed { path: String, why: &'static str },
}

/// Top-level names of CI and automation configuration (matched case-insensitively, as a directory or a file, and
/// with any extension): a patch that changes them could rewrite what CI runs or how the repository is merged.
const AUTOMATION: &[&str] = &[
    ".forgejo",
    ".github",
    ".gitea",
    ".woodpecker",
    ".gitlab-ci",
    ".gitlab",
    ".circleci",
    ".drone",
    ".travis",
    ".buildkite",
    ".ci",
    ".git",
    ".gitmodules",
    ".gitattributes",
    ".pre-commit-config",
    "jenkinsfile",
    "azure-pipelines",
    "bitbucket-pipelines",
    "codeowners",
];

fn automation(path: &str) -> bool {
    let first = path.split('/').next().unwrap_or(path).to_ascii_lowercase();
    AUTOMATION.iter().any(|name| {
        first == *name
            || first
                .strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('.'))
    }) || path
        .split('/')
        .any(|c| c.eq_ignore_ascii_case("codeowners"))
}

/// Refuses a patch that changes a file outside `targets` or any CI and automation file (even a configured one).
pub fn check_scope(files: &[FileContent], targets: &[String]) -> Result<(), PatchError> {
    for f in files {
        let why = if automation(&f.path) {
            "CI and repository automation are never changed by the factory"
        } else if !targets.iter().any(|t| t == &f.path) {
            "it is not one of the configured target files"
        } else {
            continue;
        };
        return Err(PatchError::Disallowed {
            path: f.path.clone(),
            why,
        });
    }
    Ok(())
}

fn valid_path(path: &str) -> bool {
    !path.is_empty()
        && path.len() <= 300
        && !path.starts_with('/')
        && !path.contains('\\')
        && !path.chars().any(char::is_control)
        && path
            .split('/')
            .all(|c| !c.is_empty() && c != ".." && c != ".")
        && path.split('/').next() != Some(".git")
}

/// Parses a fix model answer into the files it rewrites (in order of appearance).
pub fn parse_patch(text: &str) -> Result<Vec<FileContent>, PatchError> {
    let mut files: Vec<FileContent> = Vec::new();
    let mut lines = text.lines();
    while let Some(line) = lines.next() {
        let Some(path) = line.strip_prefix("=== ") else {
            continue;
        };
        let path = path.trim().to_string();
        if !valid_path(&path) {
            return Err(PatchError::BadPath(path));
        }
        let fence = match lines.next() {
            Some(open) if open.starts_with("```") => {
                let n = open.chars().take_while(|c| *c == '`').count();
                "`".repeat(n)
            }
            _ => return Err(PatchError::MissingFence(path)),
        };
        let mut content = String::new();
        let mut closed = false;
        for body in lines.by_ref() {
            if body.trim_end() == fence {
                closed = true;
                break;
            }
            content.push_str(body);
            content.push('\n');
            if content.len() > MAX_FILE_BYTES {
                return Err(PatchError::TooLarge(path));
            }
        }
        if !closed {
            return Err(PatchError::Unclosed(path));
        }
        if files.iter().any(|f| f.path == path) {
            return Err(PatchError::Duplicate(path));
        }
        if files.len() == MAX_FILES {
            return Err(PatchError::TooMany);
        }
        files.push(FileContent {
            path,
            content: Some(content),
        });
    }
    if files.is_empty() {
        Err(PatchError::NoFiles)
    } else {
        Ok(files)
    }
}

/// Renders files in the same format the model is asked to answer in; a missing file is shown as such.
pub fn render_files(files: &[FileContent]) -> String {
    let mut out = String::new();
    for f in files {
        out.push_str("=== ");
        out.push_str(&f.path);
        out.push('\n');
        match &f.content {
            None => out.push_str("(file does not exist)\n"),
            Some(content) => {
                // One backtick more than the longest run inside the content, and at least three.
                let longest = content.split(|c| c != '`').map(str::len).max().unwrap_or(0);
                let fence = "`".repeat(longest.max(2) + 1);
                out.push_str(&fence);
                out.push('\n');
                out.push_str(content);
                if !content.ends_with('\n') {
                    out.push('\n');
                }
                out.push_str(&fence);
                out.push('\n');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_blocks_and_ignores_prose() {
        let text = "Here is the fix.\n=== src/a.py\n```python\nx = 1\n```\nand\n=== b/c.txt\n````\n```\ninner\n```\n````\n";
        let files = parse_patch(text).unwrap();
        assert_eq!(files.len(), 2);
        assert_eq!(
            files[0],
            FileContent {
                path: "src/a.py".into(),
                content: Some("x = 1\n".into())
            }
        );
        assert_eq!(files[1].content.as_deref(), Some("```\ninner\n```\n"));
    }

    #[test]
    fn round_trips_rendered_files() {
        let files = vec![
            FileContent {
                path: "a.md".into(),
                content: Some("text\n```\ncode\n```\n".into()),
            },
            FileContent {
                path: "src/b.rs".into(),
                content: Some("fn main() {}\n".into()),
            },
        ];
        assert_eq!(parse_patch(&render_files(&files)).unwrap(), files);
    }

    #[test]
    fn errors() {
        assert_eq!(parse_patch("no blocks at all"), Err(PatchError::NoFiles));
        assert_eq!(
            parse_patch("=== a.py\nx = 1\n"),
            Err(PatchError::MissingFence("a.py".into()))
        );
        assert_eq!(
            parse_patch("=== a.py\n```\nx = 1\n"),
            Err(PatchError::Unclosed("a.py".into()))
        );
        for bad in [
            "/etc/passwd",
            "../x",
            "a/../../x",
            ".git/config",
            "a//b",
            "",
        ] {
            assert!(
                matches!(
                    parse_patch(&format!("=== {bad}\n```\nx\n```\n")),
                    Err(PatchError::BadPath(_))
                ),
                "{bad}"
            );
        }
        let dup = "=== a\n```\n1\n```\n=== a\n```\n2\n```\n";
        assert_eq!(parse_patch(dup), Err(PatchError::Duplicate("a".into())));
        let big = format!("=== a\n```\n{}\n```\n", "x".repeat(MAX_FILE_BYTES + 1));
        assert_eq!(parse_patch(&big), Err(PatchError::TooLarge("a".into())));
    }

    #[test]
    fn scope_is_the_target_files_without_automation() {
        let patch = |paths: &[&str]| -> Vec<FileContent> {
            paths
                .iter()
                .map(|p| FileContent {
                    path: (*p).into(),
                    content: Some("x\n".into()),
                })
                .collect()
        };
        let targets: Vec<String> = [
            "src/checkout.py",
            "src/cart.py",
            ".github/workflows/ci.yml",
            ".woodpecker.yml",
        ]
        .map(String::from)
        .into();
        assert_eq!(
            check_scope(&patch(&["src/checkout.py", "src/cart.py"]), &targets),
            Ok(())
        );
        let refused = |paths: &[&str]| match check_scope(&patch(paths), &targets) {
            Err(PatchError::Disallowed { path, .. }) => path,
            other => panic!("{paths:?}: {other:?}"),
        };
        assert_eq!(
            refused(&["src/checkout.py", "src/other.py"]),
            "src/other.py"
        );
        assert_eq!(refused(&["src/Checkout.py"]), "src/Checkout.py");
        // Configured or not, CI and automation stay out of reach.
        assert_eq!(
            refused(&[".github/workflows/ci.yml"]),
            ".github/workflows/ci.yml"
        );
        assert_eq!(refused(&[".woodpecker.yml"]), ".woodpecker.yml");
        for p in [
            ".forgejo/workflows/x.yml",
            ".gitea/workflows/x.yaml",
            ".woodpecker/build.yml",
            ".GitHub/workflows/x.yml",
            ".gitlab-ci.yml",
            "Jenkinsfile",
            ".ci/run",
            "docs/CODEOWNERS",
            ".gitmodules",
        ] {
            let err = check_scope(&patch(&[p]), &[p.to_string()]).unwrap_err();
            assert!(err.to_string().contains("never changed"), "{p}: {err}");
        }
        assert!(!automation("src/github_client.py"));
        assert!(!automation(".githubish/x"));
    }
}

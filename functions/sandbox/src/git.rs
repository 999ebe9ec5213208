//! A tiny content-addressed commit store: enough git for branches, file edits, merges and diffs.

use crate::util::sha1_hex;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

pub(crate) type Tree = BTreeMap<String, String>;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct Commit {
    pub sha: String,
    pub parent: Option<String>,
    /// The merged-in head of a merge commit (git's second parent); absent in state files written before merges had it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub merge_parent: Option<String>,
    pub tree: Tree,
    pub message: String,
    pub time_ms: i64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct Repo {
    pub owner: String,
    pub name: String,
    pub default_branch: String,
    pub commits: BTreeMap<String, Commit>,
    pub branches: BTreeMap<String, String>,
}

/// The git blob id of a file's content (`sha1("blob <len>\0<content>")`), as Forgejo reports it.
pub(crate) fn blob_sha(content: &str) -> String {
    let mut data = format!("blob {}\0", content.len()).into_bytes();
    data.extend_from_slice(content.as_bytes());
    sha1_hex(&data)
}

pub(crate) fn tree_sha(tree: &Tree) -> String {
    let mut data = Vec::new();
    for (path, content) in tree {
        data.extend_from_slice(path.as_bytes());
        data.push(0);
        data.extend_from_slice(blob_sha(content).as_bytes());
        data.push(b'\n');
    }
    sha1_hex(&data)
}

impl Repo {
    pub fn seed(owner: &str, name: &str, default_branch: &str, files: &Tree, now_ms: i64) -> Repo {
        let mut repo = Repo {
            owner: owner.into(),
            name: name.into(),
            default_branch: default_branch.into(),
            commits: BTreeMap::new(),
            branches: BTreeMap::new(),
        };
        let sha = repo.add_commit([None, None], files.clone(), "Initial commit", now_ms);
        repo.branches.insert(default_branch.into(), sha);
        repo
    }

    /// Stores a commit with its first and (for a merge) second parent and returns its id. The id covers parents,
    /// tree, message and time, so two commits with the same content at different times differ, as in git.
    pub fn add_commit(
        &mut self,
        [parent, merge_parent]: [Option<&str>; 2],
        tree: Tree,
        message: &str,
        now_ms: i64,
    ) -> String {
        let mut encoded = format!(
            "tree {}\nparent {}\n",
            tree_sha(&tree),
            parent.unwrap_or("")
        );
        if let Some(second) = merge_parent {
            encoded.push_str(&format!("parent {second}\n"));
        }
        encoded.push_str(&format!("time {now_ms}\n\n{message}"));
        let sha = sha1_hex(encoded.as_bytes());
        self.commits.insert(
            sha.clone(),
            Commit {
                sha: sha.clone(),
                parent: parent.map(str::to_owned),
                merge_parent: merge_parent.map(str::to_owned),
                tree,
                message: message.into(),
                time_ms: now_ms,
            },
        );
        sha
    }

    /// A branch name, a full commit id, or an unambiguous prefix of at least 7 hex digits.
    pub fn resolve(&self, reference: &str) -> Option<&Commit> {
        if let Some(sha) = self.branches.get(reference) {
            return self.commits.get(sha);
        }
        if let Some(c) = self.commits.get(reference) {
            return Some(c);
        }
        if reference.len() >= 7 && reference.bytes().all(|b| b.is_ascii_hexdigit()) {
            let mut hits = self
                .commits
                .range(reference.to_owned()..)
                .take_while(|(k, _)| k.starts_with(reference));
            let first = hits.next()?;
            if hits.next().is_none() {
                return Some(first.1);
            }
        }
        None
    }

    pub fn head(&self, branch: &str) -> Option<&Commit> {
        self.branches
            .get(branch)
            .and_then(|sha| self.commits.get(sha))
    }

    /// The tree of a commit's first parent; empty for a root commit. Diffs and stats compare against it, as
    /// Forgejo does for merge commits too.
    pub fn parent_tree(&self, c: &Commit) -> Tree {
        c.parent
            .as_ref()
            .and_then(|p| self.commits.get(p))
            .map(|p| p.tree.clone())
            .unwrap_or_default()
    }

    pub fn default_tree(&self) -> Option<&Tree> {
        self.head(&self.default_branch).map(|c| &c.tree)
    }
}

/// Lines compared by the diff include their newline, so a missing final newline is a real change.
fn lines(s: &str) -> Vec<&str> {
    s.split_inclusive('\n').collect()
}

#[derive(Clone, Copy)]
enum Op {
    Eq(usize),
    Del(usize),
    Ins(usize),
}

/// Product of line counts above which the quadratic LCS is skipped and the file shown as fully replaced.
const MAX_LCS_CELLS: usize = 4_000_000;

fn edit_script(a: &[&str], b: &[&str]) -> Vec<Op> {
    let (n, m) = (a.len(), b.len());
    if n.saturating_mul(m) > MAX_LCS_CELLS {
        return (0..n).map(Op::Del).chain((0..m).map(Op::Ins)).collect();
    }
    // lcs[i][j] = LCS length of a[i..] and b[j..]
    let w = m + 1;
    let mut lcs = vec![0u32; (n + 1) * w];
    for i in (0..n).rev() {
        for j in (0..m).rev() {
            lcs[i * w + j] = if a[i] == b[j] {
                lcs[(i + 1) * w + j + 1] + 1
            } else {
                lcs[(i + 1) * w + j].max(lcs[i * w + j + 1])
            };
        }
    }
    let (mut i, mut j, mut ops) = (0, 0, Vec::with_capacity(n + m));
    while i < n || j < m {
        if i < n && j < m && a[i] == b[j] {
            ops.push(Op::Eq(i));
            i += 1;
            j += 1;
        } else if i < n && (j == m || lcs[(i + 1) * w + j] >= lcs[i * w + j + 1]) {
            // deletions before insertions, as git prints them
            ops.push(Op::Del(i));
            i += 1;
        } else {
            ops.push(Op::Ins(j));
            j += 1;
        }
    }
    ops
}

fn push_line(out: &mut String, prefix: char, line: &str) {
    out.push(prefix);
    out.push_str(line);
    if !line.ends_with('\n') {
        out.push_str("\n\\ No newline at end of file\n");
    }
}

fn range(start: usize, count: usize) -> String {
    match count {
        0 => format!("{start},0"),
        1 => format!("{}", start + 1),
        _ => format!("{},{count}", start + 1),
    }
}

const CONTEXT: usize = 3;

fn file_hunks(out: &mut String, old: &str, new: &str) {
    let (a, b) = (lines(old), lines(new));
    let ops = edit_script(&a, &b);
    // position in a and b before each op
    let mut pos = Vec::with_capacity(ops.len() + 1);
    let (mut pa, mut pb) = (0, 0);
    for op in &ops {
        pos.push((pa, pb));
        match op {
            Op::Eq(_) => {
                pa += 1;
                pb += 1;
            }
            Op::Del(_) => pa += 1,
            Op::Ins(_) => pb += 1,
        }
    }
    let changes: Vec<usize> = ops
        .iter()
        .enumerate()
        .filter(|(_, o)| !matches!(o, Op::Eq(_)))
        .map(|(i, _)| i)
        .collect();
    let mut k = 0;
    while k < changes.len() {
        let first = changes[k];
        let mut last = first;
        while k + 1 < changes.len() && changes[k + 1] <= last + 2 * CONTEXT + 1 {
            k += 1;
            last = changes[k];
        }
        k += 1;
        let start = first.saturating_sub(CONTEXT);
        let end = (last + CONTEXT + 1).min(ops.len());
        let slice = &ops[start..end];
        let old_count = slice.iter().filter(|o| !matches!(o, Op::Ins(_))).count();
        let new_count = slice.iter().filter(|o| !matches!(o, Op::Del(_))).count();
        let (sa, sb) = pos[start];
        out.push_str(&format!(
            "@@ -{} +{} @@\n",
            range(sa, old_count),
            range(sb, new_count)
        ));
        for op in slice {
            match *op {
                Op::Eq(i) => push_line(out, ' ', a[i]),
                Op::Del(i) => push_line(out, '-', a[i]),
                Op::Ins(j) => push_line(out, '+', b[j]),
            }
        }
    }
}

/// One changed file of a commit, as `git diff --numstat` plus the change kind Forgejo reports.
pub(crate) struct FileStat {
    pub path: String,
    /// `added`, `removed` or `modified`
    pub status: &'static str,
    pub additions: usize,
    pub deletions: usize,
}

/// Per-file line counts of the change from `old` to `new`, in path order.
pub(crate) fn diff_stat(old: &Tree, new: &Tree) -> Vec<FileStat> {
    let paths: std::collections::BTreeSet<&String> = old.keys().chain(new.keys()).collect();
    let mut out = Vec::new();
    for path in paths {
        let (o, n) = (old.get(path), new.get(path));
        let status = match (o, n) {
            (Some(a), Some(b)) if a == b => continue,
            (Some(_), Some(_)) => "modified",
            (None, Some(_)) => "added",
            (Some(_), None) => "removed",
            (None, None) => continue,
        };
        let (a, b) = (
            lines(o.map_or("", String::as_str)),
            lines(n.map_or("", String::as_str)),
        );
        let ops = edit_script(&a, &b);
        out.push(FileStat {
            path: path.clone(),
            status,
            additions: ops.iter().filter(|op| matches!(op, Op::Ins(_))).count(),
            deletions: ops.iter().filter(|op| matches!(op, Op::Del(_))).count(),
        });
    }
    out
}

/// A git-style unified diff turning `old` into `new`.
pub(crate) fn diff(old: &Tree, new: &Tree) -> String {
    let mut out = String::new();
    let paths: std::collections::BTreeSet<&String> = old.keys().chain(new.keys()).collect();
    for path in paths {
        match (old.get(path), new.get(path)) {
            (Some(o), Some(n)) if o == n => {}
            (Some(o), Some(n)) => {
                out.push_str(&format!("diff --git a/{path} b/{path}\n"));
                out.push_str(&format!(
                    "index {}..{} 100644\n",
                    &blob_sha(o)[..7],
                    &blob_sha(n)[..7]
                ));
                out.push_str(&format!("--- a/{path}\n+++ b/{path}\n"));
                file_hunks(&mut out, o, n);
            }
            (None, Some(n)) => {
                out.push_str(&format!(
                    "diff --git a/{path} b/{path}\nnew file mode 100644\n"
                ));
                out.push_str(&format!("index 0000000..{}\n", &blob_sha(n)[..7]));
                out.push_str(&format!("--- /dev/null\n+++ b/{path}\n"));
                file_hunks(&mut out, "", n);
            }
            (Some(o), None) => {
                out.push_str(&format!(
                    "diff --git a/{path} b/{path}\ndeleted file mode 100644\n"
                ));
                out.push_str(&format!("index {}..0000000\n", &blob_sha(o)[..7]));
                out.push_str(&format!("--- a/{path}\n+++ /dev/null\n"));
                file_hunks(&mut out, o, "");
            }
            (None, None) => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree(pairs: &[(&str, &str)]) -> Tree {
        pairs
            .iter()
            .map(|(p, c)| (p.to_string(), c.to_string()))
            .collect()
    }

    #[test]
    fn blob_sha_matches_git() {
        // `printf 'hello\n' | git hash-object --stdin`
        assert_eq!(
            blob_sha("hello\n"),
            "ce013625030ba8dba906f756967f9e9ca394464a"
        );
    }

    #[test]
    fn diff_of_one_changed_line_has_context() {
        let old = tree(&[("a.py", "1\n2\n3\n4\n5\n6\n7\n8\n9\n")]);
        let new = tree(&[("a.py", "1\n2\n3\n4\nfive\n6\n7\n8\n9\n")]);
        let d = diff(&old, &new);
        let hunk = d
            .split_once("+++ b/a.py\n")
            .map(|x| x.1)
            .unwrap_or_default();
        assert_eq!(hunk, "@@ -2,7 +2,7 @@\n 2\n 3\n 4\n-5\n+five\n 6\n 7\n 8\n");
        assert!(d.starts_with("diff --git a/a.py b/a.py\nindex "));
    }

    #[test]
    fn diff_of_added_and_deleted_files() {
        let old = tree(&[("gone.txt", "x")]);
        let new = tree(&[("new.txt", "a\nb\n")]);
        let d = diff(&old, &new);
        assert!(d.contains(
            "--- a/gone.txt\n+++ /dev/null\n@@ -1 +0,0 @@\n-x\n\\ No newline at end of file\n"
        ));
        assert!(d.contains("--- /dev/null\n+++ b/new.txt\n@@ -0,0 +1,2 @@\n+a\n+b\n"));
    }

    #[test]
    fn distant_changes_make_two_hunks() {
        let old: String = (1..=20).map(|i| format!("{i}\n")).collect();
        let new = old
            .replace("2\n", "two\n")
            .replacen("19\n", "nineteen\n", 1);
        let d = diff(&tree(&[("f", &old)]), &tree(&[("f", &new)]));
        assert_eq!(d.matches("@@ -").count(), 2, "{d}");
    }

    #[test]
    fn diff_stat_counts_lines_per_file() {
        let old = tree(&[("a", "1\n2\n3\n"), ("gone", "x\ny\n"), ("same", "s\n")]);
        let new = tree(&[("a", "1\ntwo\n3\n4\n"), ("new", "n\n"), ("same", "s\n")]);
        let got: Vec<(String, &str, usize, usize)> = diff_stat(&old, &new)
            .into_iter()
            .map(|f| (f.path, f.status, f.additions, f.deletions))
            .collect();
        assert_eq!(
            got,
            vec![
                ("a".to_string(), "modified", 2, 1),
                ("gone".to_string(), "removed", 0, 2),
                ("new".to_string(), "added", 1, 0),
            ]
        );
    }

    #[test]
    fn merge_parent_changes_the_commit_id() {
        let mut repo = Repo::seed("o", "r", "main", &tree(&[("a", "1")]), 1);
        let base = repo.head("main").map(|c| c.sha.clone()).unwrap_or_default();
        let t = tree(&[("a", "2")]);
        let plain = repo.add_commit([Some(&base), None], t.clone(), "m", 5);
        let merge = repo.add_commit([Some(&base), Some("feed")], t, "m", 5);
        assert_ne!(plain, merge);
        assert_eq!(
            repo.commits
                .get(&merge)
                .and_then(|c| c.merge_parent.as_deref()),
            Some("feed")
        );
    }

    #[test]
    fn resolve_by_branch_sha_and_prefix() {
        let repo = Repo::seed("o", "r", "main", &tree(&[("a", "1")]), 1);
        let head = repo.head("main").map(|c| c.sha.clone()).unwrap_or_default();
        assert_eq!(repo.resolve("main").map(|c| &c.sha), Some(&head));
        assert_eq!(repo.resolve(&head[..8]).map(|c| &c.sha), Some(&head));
        assert!(repo.resolve("nope").is_none());
    }
}

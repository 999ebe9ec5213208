//! The declarative CI check run over a pushed tree; its failure description is "the CI log".

use crate::git::Tree;
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct CiRule {
    pub path: String,
    #[serde(default)]
    pub must_contain: Vec<String>,
    #[serde(default)]
    pub must_not_contain: Vec<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct CiCheck {
    pub rules: Vec<CiRule>,
    /// How long a new commit's status stays `pending` before it settles.
    pub delay_ms: u64,
}

impl Default for CiCheck {
    fn default() -> Self {
        CiCheck {
            rules: vec![CiRule {
                path: "src/checkout.py".into(),
                must_contain: vec!["percent / 100".into()],
                must_not_contain: vec!["/ 0\n".into()],
            }],
            delay_ms: 0,
        }
    }
}

impl CiCheck {
    /// Every failed expectation, in rule order; empty means the tree passes.
    pub fn failures(&self, tree: &Tree) -> Vec<String> {
        let mut failed = Vec::new();
        for rule in &self.rules {
            let Some(content) = tree.get(&rule.path) else {
                failed.push(format!("{}: file is missing", rule.path));
                continue;
            };
            for needle in &rule.must_contain {
                if !content.contains(needle.as_str()) {
                    failed.push(format!("{}: expected to contain {needle:?}", rule.path));
                }
            }
            for needle in &rule.must_not_contain {
                if content.contains(needle.as_str()) {
                    failed.push(format!("{}: must not contain {needle:?}", rule.path));
                }
            }
        }
        failed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_check_names_what_failed() {
        let check = CiCheck::default();
        let broken: Tree = [(
            "src/checkout.py".to_string(),
            "x = price * percent / 0\n".to_string(),
        )]
        .into();
        let fixed: Tree = [(
            "src/checkout.py".to_string(),
            "x = price * percent / 100\n".to_string(),
        )]
        .into();
        let f = check.failures(&broken);
        assert_eq!(f.len(), 2);
        assert!(f[0].contains("percent / 100") && f[1].contains("must not contain"));
        assert!(check.failures(&fixed).is_empty());
        assert_eq!(
            check.failures(&Tree::new()),
            vec!["src/checkout.py: file is missing".to_string()]
        );
    }
}

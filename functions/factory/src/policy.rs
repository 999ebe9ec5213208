//! The organisation's policy: (agent, skill, environment) -> allow | approve | deny.

use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Risk {
    Read,
    Write,
    Destructive,
}

impl Risk {
    pub fn as_str(self) -> &'static str {
        match self {
            Risk::Read => "read",
            Risk::Write => "write",
            Risk::Destructive => "destructive",
        }
    }
}

/// The risk tag of a skill as the agents' cards declare it (docs/contracts.md). An unknown skill is treated as
/// destructive so that it can never run without an approval.
pub fn risk_of(agent: &str, skill: &str) -> Risk {
    match (agent, skill) {
        ("zulip", "read")
        | ("plane", "get_issue")
        | ("forgejo", "read_files" | "get_pr" | "ci_status")
        | ("glitchtip", "get_issue" | "issue_events")
        | ("analytics", "series") => Risk::Read,
        ("zulip", "open_thread" | "post")
        | ("plane", "create_issue" | "comment" | "set_state")
        | ("forgejo", "commit_patch" | "open_pr")
        | ("glitchtip", "resolve") => Risk::Write,
        _ => Risk::Destructive,
    }
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    Allow,
    Approve,
    Deny,
}

/// One rule; an absent field matches anything. The first matching rule wins.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skill: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<String>,
    pub verdict: Verdict,
}

/// A versioned policy document. Without a matching rule the defaults of DESIGN.md section 5 apply: read allow;
/// write allow outside protected environments and approve inside; destructive approve; merge and deploy approve
/// everywhere. Whatever a rule says, the engine's safety wall still requires an approval for destructive skills.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(default)]
pub struct Policy {
    pub version: u32,
    /// Triage decisions are taken by policy instead of a person.
    pub auto_triage: bool,
    /// Environments where writes need an approval. Empty by default: the factory's own writes (a thread, an
    /// issue, a branch) do not change production, and its production change (the merge) is always gated.
    pub protected_envs: Vec<String>,
    pub rules: Vec<Rule>,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            version: 1,
            auto_triage: false,
            protected_envs: Vec::new(),
            rules: Vec::new(),
        }
    }
}

impl Policy {
    pub fn decide(&self, agent: &str, skill: &str, risk: Risk, env: &str) -> Verdict {
        let hit = |field: &Option<String>, value: &str| field.as_deref().is_none_or(|f| f == value);
        if let Some(rule) = self
            .rules
            .iter()
            .find(|r| hit(&r.agent, agent) && hit(&r.skill, skill) && hit(&r.env, env))
        {
            return rule.verdict;
        }
        if matches!(skill, "merge" | "deploy") {
            return Verdict::Approve;
        }
        match risk {
            Risk::Read => Verdict::Allow,
            Risk::Write if self.protected_envs.iter().any(|e| e == env) => Verdict::Approve,
            Risk::Write => Verdict::Allow,
            Risk::Destructive => Verdict::Approve,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn risk_tags_follow_the_cards() {
        assert_eq!(risk_of("forgejo", "ci_status"), Risk::Read);
        assert_eq!(risk_of("zulip", "post"), Risk::Write);
        assert_eq!(risk_of("forgejo", "merge"), Risk::Destructive);
        assert_eq!(risk_of("forgejo", "close_pr"), Risk::Destructive);
        assert_eq!(risk_of("forgejo", "revert"), Risk::Destructive);
        assert_eq!(risk_of("zulip", "delete_everything"), Risk::Destructive);
    }

    #[test]
    fn defaults() {
        let mut p = Policy::default();
        assert_eq!(
            p.decide("forgejo", "read_files", Risk::Read, "production"),
            Verdict::Allow
        );
        assert_eq!(
            p.decide("zulip", "post", Risk::Write, "production"),
            Verdict::Allow
        );
        assert_eq!(
            p.decide("forgejo", "close_pr", Risk::Destructive, "staging"),
            Verdict::Approve
        );
        assert_eq!(
            p.decide("forgejo", "merge", Risk::Destructive, "dev"),
            Verdict::Approve
        );
        p.protected_envs = vec!["production".into()];
        assert_eq!(
            p.decide("zulip", "post", Risk::Write, "production"),
            Verdict::Approve
        );
        assert_eq!(
            p.decide("zulip", "post", Risk::Write, "staging"),
            Verdict::Allow
        );
    }

    #[test]
    fn first_matching_rule_wins() {
        let p = Policy {
            rules: vec![
                Rule {
                    agent: Some("plane".into()),
                    skill: None,
                    env: Some("production".into()),
                    verdict: Verdict::Deny,
                },
                Rule {
                    agent: Some("plane".into()),
                    skill: None,
                    env: None,
                    verdict: Verdict::Approve,
                },
            ],
            ..Policy::default()
        };
        assert_eq!(
            p.decide("plane", "comment", Risk::Write, "production"),
            Verdict::Deny
        );
        assert_eq!(
            p.decide("plane", "comment", Risk::Write, "dev"),
            Verdict::Approve
        );
        assert_eq!(
            p.decide("zulip", "post", Risk::Write, "production"),
            Verdict::Allow
        );
    }
}

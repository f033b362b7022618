//! Topic names, in the two views that exist: what a device sees
//! (`ai/v1/{device}/req`) and what the broker's router sees.
//!
//! Every topic and filter of a device is *mounted* under its private
//! prefix `d/{device}/` before the router sees it, and unmounted again on
//! the way out ([`super::codec`]). A device can therefore only ever
//! match topics of its own subtree, whatever wildcards it uses. The
//! read-only shared topics (`{prefix}/shared/…`, e.g. the model catalogue)
//! live under `s/`; only edgeway publishes there. A device's topics that
//! start with `$` are mounted under `x/{device}/` instead, so that, as MQTT
//! requires, filters starting with a wildcard never match them.

/// Router-side prefix of every device's private subtree: `d/{device}/`.
pub const DEVICE_MOUNT: &str = "d/";
/// Router-side prefix of the read-only shared topics.
pub const SHARED_MOUNT: &str = "s/";
/// Router-side prefix of a device's topics that start with `$`:
/// `x/{device}/$…`.
pub const DOLLAR_MOUNT: &str = "x/";

/// What a device publishes to edgeway, by the last topic level.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Inbound {
    Request,
    Cancel,
    Resume,
}

/// The device topics under one prefix (`ai/v1` by default).
#[derive(Debug, Clone)]
pub struct Topics {
    prefix: String,
}

impl Topics {
    pub fn new(prefix: &str) -> Topics {
        Topics { prefix: prefix.trim_matches('/').to_string() }
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Device view: `{prefix}/shared/` (filters starting with it read the
    /// shared topics).
    pub fn shared_prefix(&self) -> String {
        format!("{}/shared/", self.prefix)
    }

    /// Device view of the retained model catalogue.
    pub fn catalogue(&self) -> String {
        format!("{}/shared/models", self.prefix)
    }

    /// Device view of a device's namespace, with the trailing `/`.
    pub fn device_space(&self, device: &str) -> String {
        format!("{}/{device}/", self.prefix)
    }

    /// Device view of the default response topic of a request.
    pub fn response(&self, device: &str, request_id: &str) -> String {
        format!("{}/{device}/res/{request_id}", self.prefix)
    }

    /// The router filter of edgeway's own link: every device's
    /// `{prefix}/{x}/{kind}` (requests, cancels and resumes in one log, so
    /// their order is kept).
    pub fn gateway_filter(&self) -> String {
        format!("{DEVICE_MOUNT}+/{}/+/+", self.prefix)
    }

    /// Reads a router topic that edgeway's link received: the device that
    /// published it and what it is. `None` for anything else, including a
    /// device publishing into another device's topics.
    pub fn parse_inbound<'a>(&self, internal: &'a str) -> Option<(&'a str, Inbound)> {
        let rest = internal.strip_prefix(DEVICE_MOUNT)?;
        let (device, topic) = rest.split_once('/')?;
        let topic = topic.strip_prefix(self.prefix.as_str())?.strip_prefix('/')?;
        let (owner, kind) = topic.split_once('/')?;
        if owner != device {
            return None;
        }
        let kind = match kind {
            "req" => Inbound::Request,
            "cancel" => Inbound::Cancel,
            "resume" => Inbound::Resume,
            _ => return None,
        };
        Some((device, kind))
    }

    /// Router topic for a device-view topic of `device` (edgeway publishing
    /// into a device's subtree).
    pub fn internal(&self, device: &str, device_topic: &str) -> String {
        mount_topic(device, device_topic)
    }

    /// Router topic of a shared (device-view) topic.
    pub fn internal_shared(&self, device_topic: &str) -> String {
        format!("{SHARED_MOUNT}{device_topic}")
    }

    /// Whether a device-view topic lies in `device`'s namespace and is not
    /// one of the topics devices publish to edgeway (so it can carry
    /// responses).
    pub fn valid_response_topic(&self, device: &str, topic: &str) -> bool {
        let Some(rest) = topic.strip_prefix(&self.device_space(device)) else { return false };
        !rest.is_empty()
            && !topic.contains(['+', '#'])
            && !matches!(rest, "req" | "cancel" | "resume")
            && rest.split('/').all(|l| !l.is_empty())
    }
}

/// `d/{device}/{topic}` (`x/{device}/{topic}` for a topic starting with
/// `$`).
pub fn mount_topic(device: &str, topic: &str) -> String {
    let mount = if topic.starts_with('$') { DOLLAR_MOUNT } else { DEVICE_MOUNT };
    let mut s = String::with_capacity(mount.len() + device.len() + 1 + topic.len());
    s.push_str(mount);
    s.push_str(device);
    s.push('/');
    s.push_str(topic);
    s
}

/// The router filter for a device's subscription filter. Shared
/// subscriptions (`$share/{group}/…`) become plain ones: a device's private
/// subtree has one subscriber, so a group of one is the same thing.
pub fn mount_filter(device: &str, shared_prefix: &str, filter: &str) -> String {
    let filter = match filter.strip_prefix("$share/").and_then(|s| s.split_once('/')) {
        Some((_group, f)) => f,
        None => filter,
    };
    if filter.starts_with(shared_prefix) || Some(filter) == shared_prefix.strip_suffix('/') {
        format!("{SHARED_MOUNT}{filter}")
    } else {
        mount_topic(device, filter)
    }
}

/// The device view of a router topic delivered to `device`; `None` if the
/// topic is neither in its subtree nor shared (which the mounting rules
/// make impossible).
pub fn unmount<'a>(device: &str, internal: &'a str) -> Option<&'a str> {
    if let Some(rest) = internal.strip_prefix(DEVICE_MOUNT).or_else(|| internal.strip_prefix(DOLLAR_MOUNT)) {
        let rest = rest.strip_prefix(device)?;
        return rest.strip_prefix('/');
    }
    internal.strip_prefix(SHARED_MOUNT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_topics_and_filters_stay_in_their_subtree() {
        let sp = "ai/v1/shared/";
        assert_eq!(mount_filter("dev1", sp, "#"), "d/dev1/#");
        assert_eq!(mount_filter("dev1", sp, "ai/v1/+/res/#"), "d/dev1/ai/v1/+/res/#");
        assert_eq!(mount_filter("dev1", sp, "ai/v1/dev2/res/x"), "d/dev1/ai/v1/dev2/res/x");
        assert_eq!(mount_filter("dev1", sp, "$share/g/ai/v1/dev2/#"), "d/dev1/ai/v1/dev2/#");
        // `$` topics apart: `#` and `+/…` must not match them.
        assert_eq!(mount_filter("dev1", sp, "$SYS/#"), "x/dev1/$SYS/#");
        assert_eq!(mount_topic("dev1", "$TopicA/B"), "x/dev1/$TopicA/B");
        assert_eq!(unmount("dev1", "x/dev1/$TopicA/B"), Some("$TopicA/B"));
        assert_eq!(unmount("dev1", "x/dev2/$TopicA/B"), None);
        assert_eq!(mount_filter("dev1", sp, "ai/v1/shared/models"), "s/ai/v1/shared/models");
        assert_eq!(mount_filter("dev1", sp, "ai/v1/shared/#"), "s/ai/v1/shared/#");
        assert_eq!(mount_filter("dev1", sp, "ai/v1/shared"), "s/ai/v1/shared");
        assert_eq!(mount_topic("dev1", "ai/v1/dev1/req"), "d/dev1/ai/v1/dev1/req");
        assert_eq!(unmount("dev1", "d/dev1/ai/v1/dev1/res/r1"), Some("ai/v1/dev1/res/r1"));
        assert_eq!(unmount("dev1", "d/dev10/x"), None);
        assert_eq!(unmount("dev1", "d/dev2/x"), None);
        assert_eq!(unmount("dev1", "s/ai/v1/shared/models"), Some("ai/v1/shared/models"));
    }

    #[test]
    fn edgeway_only_reads_a_devices_own_control_topics() {
        let t = Topics::new("ai/v1");
        assert_eq!(t.gateway_filter(), "d/+/ai/v1/+/+");
        assert_eq!(t.parse_inbound("d/dev1/ai/v1/dev1/req"), Some(("dev1", Inbound::Request)));
        assert_eq!(t.parse_inbound("d/dev1/ai/v1/dev1/cancel"), Some(("dev1", Inbound::Cancel)));
        assert_eq!(t.parse_inbound("d/dev1/ai/v1/dev1/resume"), Some(("dev1", Inbound::Resume)));
        assert_eq!(t.parse_inbound("d/dev1/ai/v1/dev2/req"), None, "a publish into another device's topics");
        assert_eq!(t.parse_inbound("d/dev1/ai/v1/dev1/other"), None);
        assert_eq!(t.parse_inbound("s/ai/v1/dev1/req"), None);
        assert!(t.valid_response_topic("dev1", "ai/v1/dev1/answers/7"));
        assert!(!t.valid_response_topic("dev1", "ai/v1/dev2/res/7"));
        assert!(!t.valid_response_topic("dev1", "ai/v1/dev1/req"));
        assert!(!t.valid_response_topic("dev1", "ai/v1/dev1/res/+"));
        assert!(!t.valid_response_topic("dev1", "ai/v1/dev1/"));
    }
}

//! Topic names, in the two views that exist: what a device sees
//! (`ai/v1/{device}/req`) and what the broker's router sees.
//!
//! Every topic and filter of a device is *mounted* under its private
//! prefix `d/{tenant}/{device}/` before the router sees it, and unmounted
//! again on the way out ([`super::codec`]). A device can therefore only
//! ever match topics of its own subtree, whatever wildcards it uses, and a
//! device id used under two tenants (JWT devices name themselves) would
//! still get two subtrees. The pair `{tenant}/{device}` is the device's
//! *mount* ([`mount_name`]): the MQTT ingress knows devices by it, so
//! sessions, streams and resumes are per tenant too. Devices never see it:
//! their topics stay `{prefix}/{device}/…`. The read-only shared topics
//! (`{prefix}/shared/…`, e.g. the model catalogue) live under `s/`; only
//! edgeway publishes there. A device's topics that start with `$` are
//! mounted under `x/{tenant}/{device}/` instead, so that, as MQTT
//! requires, filters starting with a wildcard never match them.
//!
//! On an external broker (`[mqtt] mode = "external"`) there is no router
//! view: [`Topics::unmounted`] makes the "router" topics the device-view
//! ones, and the broker's ACLs keep devices apart.

use sha2::{Digest, Sha256};

/// Router-side prefix of every device's private subtree:
/// `d/{tenant}/{device}/`.
pub const DEVICE_MOUNT: &str = "d/";
/// Router-side prefix of the read-only shared topics.
pub const SHARED_MOUNT: &str = "s/";
/// Router-side prefix of a device's topics that start with `$`:
/// `x/{tenant}/{device}/$…`.
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
    /// Whether edgeway publishes into a router that mounts devices (the
    /// embedded broker), or straight to the device-view topics of an
    /// external broker.
    mounted: bool,
}

impl Topics {
    pub fn new(prefix: &str) -> Topics {
        Topics { prefix: prefix.trim_matches('/').to_string(), mounted: true }
    }

    /// The topics on an external broker: [`Self::internal`] and
    /// [`Self::internal_shared`] are the device-view topics themselves.
    pub fn unmounted(prefix: &str) -> Topics {
        Topics { mounted: false, ..Topics::new(prefix) }
    }

    /// The filters edgeway subscribes to on an external broker: requests
    /// shared among the nodes of `group` (each request goes to one node);
    /// cancels and resumes to every node, as only the node that runs the
    /// request knows it (the others ignore them).
    pub fn external_filters(&self, group: &str) -> [String; 3] {
        [
            format!("$share/{group}/{}/+/req", self.prefix),
            format!("{}/+/cancel", self.prefix),
            format!("{}/+/resume", self.prefix),
        ]
    }

    /// Reads a device-view topic of an external broker: the device id in
    /// it and what it is. The broker's ACLs guarantee that only that device
    /// may publish there.
    pub fn parse_device_view<'a>(&self, topic: &'a str) -> Option<(&'a str, Inbound)> {
        let rest = topic.strip_prefix(self.prefix.as_str())?.strip_prefix('/')?;
        let (device, kind) = rest.split_once('/')?;
        let kind = match kind {
            "req" => Inbound::Request,
            "cancel" => Inbound::Cancel,
            "resume" => Inbound::Resume,
            _ => return None,
        };
        Some((device, kind))
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

    /// Device view of the topic of a compact stream (`sid`: its stream
    /// id): `{prefix}/{device}/s/{sid}`.
    pub fn compact_stream(&self, device: &str, sid: u32) -> String {
        format!("{}/{device}/s/{sid}", self.prefix)
    }

    /// The router filter of edgeway's own link: every device's
    /// `{prefix}/{x}/{kind}` (requests, cancels and resumes in one log, so
    /// their order is kept).
    pub fn gateway_filter(&self) -> String {
        format!("{DEVICE_MOUNT}+/+/{}/+/+", self.prefix)
    }

    /// Reads a router topic that edgeway's link received: the mount of the
    /// device that published it (`{tenant}/{device}`) and what it is.
    /// `None` for anything else, including a device publishing into another
    /// device's topics.
    pub fn parse_inbound<'a>(&self, internal: &'a str) -> Option<(&'a str, Inbound)> {
        let rest = internal.strip_prefix(DEVICE_MOUNT)?;
        let (tenant, rest) = rest.split_once('/')?;
        let (device, topic) = rest.split_once('/')?;
        let mount = &internal[DEVICE_MOUNT.len()..DEVICE_MOUNT.len() + tenant.len() + 1 + device.len()];
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
        Some((mount, kind))
    }

    /// Router topic for a device-view topic of the device mounted at
    /// `mount` (edgeway publishing into a device's subtree).
    pub fn internal(&self, mount: &str, device_topic: &str) -> String {
        if !self.mounted {
            return device_topic.to_string();
        }
        mount_topic(mount, device_topic)
    }

    /// Router topic of a shared (device-view) topic.
    pub fn internal_shared(&self, device_topic: &str) -> String {
        if !self.mounted {
            return device_topic.to_string();
        }
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

/// The mount of a device of a tenant: `{tenant}/{device}`, one topic level
/// per part. A tenant name that is not a safe topic level (wildcards, `/`,
/// `$`, very long) is written `={hash}`; `=` never starts a plain one.
pub fn mount_name(tenant: &str, device: &str) -> String {
    let plain =
        (1..=64).contains(&tenant.len()) && tenant.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
    if plain {
        format!("{tenant}/{device}")
    } else {
        format!("={}/{device}", &hex::encode(Sha256::digest(tenant.as_bytes()))[..32])
    }
}

/// The client id the broker's router knows a connection by:
/// `{tenant}:{device}|{client id}` (the mount with `:` for `/`, which the
/// router refuses in client ids, as the `$share` groups of
/// [`mount_filter`] write it). The router keys sessions, takeovers and
/// kept state by it, so one client id used under two tenants (a JWT-only
/// device id bound afresh) is two sessions. Devices never see it: it is
/// never sent back (edgeway refuses the empty client id, the only one the
/// broker would assign and tell). Neither part of a mount contains `:` or
/// `|`, so the id is unambiguous and the part before its first `|` is the
/// device's.
pub fn router_client_id(mount: &str, client_id: &str) -> String {
    format!("{}|{client_id}", mount.replace('/', ":"))
}

/// The device id of a mount (its last level).
pub fn device_of_mount(mount: &str) -> &str {
    mount.rsplit_once('/').map_or(mount, |(_, d)| d)
}

/// `d/{mount}/{topic}` (`x/{mount}/{topic}` for a topic starting with
/// `$`); `mount` is [`mount_name`]'s.
pub fn mount_topic(mount: &str, topic: &str) -> String {
    let prefix = if topic.starts_with('$') { DOLLAR_MOUNT } else { DEVICE_MOUNT };
    let mut s = String::with_capacity(prefix.len() + mount.len() + 1 + topic.len());
    s.push_str(prefix);
    s.push_str(mount);
    s.push('/');
    s.push_str(topic);
    s
}

/// The router filter for a device's subscription filter, `None` for a
/// malformed shared subscription (MQTT-4.8.2-1/2: `$share/` then a share
/// name of at least one character without `/`, `+` or `#`, then `/` and a
/// filter).
///
/// A shared subscription `$share/{group}/{filter}` stays shared among the
/// device's own connections (its instances, `{device}:{instance}`): it
/// becomes `$share/{tenant}:{device}:{group}/{mounted filter}`. The group
/// carries the mount because the filter alone does not tell devices apart
/// for the read-only shared topics (`s/…` for every device); `:` is in
/// neither a tenant level nor a device id, so two devices never name the
/// same group. The router keys a group by the whole string, so one name
/// on two filters is two groups (rumqttd patch 15).
pub fn mount_filter(device: &str, shared_prefix: &str, filter: &str) -> Option<String> {
    let Some(rest) = filter.strip_prefix("$share/") else {
        return Some(mount_plain_filter(device, shared_prefix, filter));
    };
    let (group, filter) = rest.split_once('/')?;
    if group.is_empty() || group.contains(['+', '#']) || filter.is_empty() {
        return None;
    }
    let mounted = mount_plain_filter(device, shared_prefix, filter);
    Some(format!("$share/{}:{group}/{mounted}", device.replace('/', ":")))
}

fn mount_plain_filter(device: &str, shared_prefix: &str, filter: &str) -> String {
    if filter.starts_with(shared_prefix) || Some(filter) == shared_prefix.strip_suffix('/') {
        format!("{SHARED_MOUNT}{filter}")
    } else {
        mount_topic(device, filter)
    }
}

/// The device view of a router topic delivered to the device mounted at
/// `device` ([`mount_name`]); `None` if the topic is neither in its subtree
/// nor shared (which the mounting rules make impossible).
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
    fn external_topics_are_the_device_view_and_name_their_device() {
        let t = Topics::unmounted("ai/v1");
        assert_eq!(t.internal("demo/cam-1", "ai/v1/cam-1/res/r1"), "ai/v1/cam-1/res/r1");
        assert_eq!(t.internal_shared("ai/v1/shared/models"), "ai/v1/shared/models");
        assert_eq!(t.parse_device_view("ai/v1/cam-1/req"), Some(("cam-1", Inbound::Request)));
        assert_eq!(t.parse_device_view("ai/v1/cam-1/cancel"), Some(("cam-1", Inbound::Cancel)));
        assert_eq!(t.parse_device_view("ai/v1/cam-1/resume"), Some(("cam-1", Inbound::Resume)));
        assert_eq!(t.parse_device_view("ai/v1/cam-1/res/r1"), None);
        assert_eq!(t.parse_device_view("ai/v2/cam-1/req"), None);
        assert_eq!(
            t.external_filters("edgeway"),
            ["$share/edgeway/ai/v1/+/req".to_string(), "ai/v1/+/cancel".into(), "ai/v1/+/resume".into()]
        );
        // The embedded broker's topics stay mounted.
        assert_eq!(Topics::new("ai/v1").internal("demo/cam-1", "ai/v1/cam-1/req"), "d/demo/cam-1/ai/v1/cam-1/req");
    }

    /// The router refuses client ids with `+$#/` (and then never answers
    /// the CONNECT): the scoped id has none, and differs per tenant.
    #[test]
    fn router_client_ids_are_per_tenant_and_valid_for_the_router() {
        let a = router_client_id(&mount_name("demo", "cam-7"), "cam-7:x");
        assert_eq!(a, "demo:cam-7|cam-7:x");
        let hashed = router_client_id(&mount_name("a/b#", "cam-7"), "cam-7:x");
        for id in [&a, &hashed, &router_client_id(&mount_name("other", "cam-7"), "cam-7:x")] {
            assert!(!id.contains(['+', '$', '#', '/']), "{id}");
        }
        assert_ne!(a, router_client_id(&mount_name("other", "cam-7"), "cam-7:x"));
        assert_ne!(a, hashed);
    }

    #[test]
    fn device_topics_and_filters_stay_in_their_subtree() {
        let sp = "ai/v1/shared/";
        assert_eq!(mount_filter("dev1", sp, "#").unwrap(), "d/dev1/#");
        assert_eq!(mount_filter("dev1", sp, "ai/v1/+/res/#").unwrap(), "d/dev1/ai/v1/+/res/#");
        assert_eq!(mount_filter("dev1", sp, "ai/v1/dev2/res/x").unwrap(), "d/dev1/ai/v1/dev2/res/x");
        assert_eq!(
            mount_filter("t/dev1", sp, "$share/g/ai/v1/dev2/#").unwrap(),
            "$share/t:dev1:g/d/t/dev1/ai/v1/dev2/#"
        );
        // A shared subscription stays one, in the device's own group.
        assert_eq!(mount_filter("t/dev1", sp, "$share/g/#").unwrap(), "$share/t:dev1:g/d/t/dev1/#");
        assert_eq!(mount_filter("t/dev1", sp, "$share/g:x/a").unwrap(), "$share/t:dev1:g:x/d/t/dev1/a");
        assert_ne!(
            mount_filter("t/dev1", sp, "$share/g/ai/v1/shared/#"),
            mount_filter("t/dev2", sp, "$share/g/ai/v1/shared/#")
        );
        for bad in ["$share/g", "$share//a", "$share/g/", "$share/g+/a", "$share/#/a", "$share/"] {
            assert_eq!(mount_filter("t/dev1", sp, bad), None, "{bad}");
        }
        // `$` topics apart: `#` and `+/…` must not match them.
        assert_eq!(mount_filter("dev1", sp, "$SYS/#").unwrap(), "x/dev1/$SYS/#");
        assert_eq!(mount_topic("dev1", "$TopicA/B"), "x/dev1/$TopicA/B");
        assert_eq!(unmount("dev1", "x/dev1/$TopicA/B"), Some("$TopicA/B"));
        assert_eq!(unmount("dev1", "x/dev2/$TopicA/B"), None);
        assert_eq!(mount_filter("dev1", sp, "ai/v1/shared/models").unwrap(), "s/ai/v1/shared/models");
        assert_eq!(mount_filter("dev1", sp, "ai/v1/shared/#").unwrap(), "s/ai/v1/shared/#");
        assert_eq!(mount_filter("dev1", sp, "ai/v1/shared").unwrap(), "s/ai/v1/shared");
        assert_eq!(mount_topic("dev1", "ai/v1/dev1/req"), "d/dev1/ai/v1/dev1/req");
        assert_eq!(unmount("dev1", "d/dev1/ai/v1/dev1/res/r1"), Some("ai/v1/dev1/res/r1"));
        assert_eq!(unmount("dev1", "d/dev10/x"), None);
        assert_eq!(unmount("dev1", "d/dev2/x"), None);
        assert_eq!(unmount("dev1", "s/ai/v1/shared/models"), Some("ai/v1/shared/models"));
    }

    #[test]
    fn edgeway_only_reads_a_devices_own_control_topics() {
        let t = Topics::new("ai/v1");
        assert_eq!(t.gateway_filter(), "d/+/+/ai/v1/+/+");
        assert_eq!(t.parse_inbound("d/t1/dev1/ai/v1/dev1/req"), Some(("t1/dev1", Inbound::Request)));
        assert_eq!(t.parse_inbound("d/t1/dev1/ai/v1/dev1/cancel"), Some(("t1/dev1", Inbound::Cancel)));
        assert_eq!(t.parse_inbound("d/t1/dev1/ai/v1/dev1/resume"), Some(("t1/dev1", Inbound::Resume)));
        assert_eq!(t.parse_inbound("d/t1/dev1/ai/v1/dev2/req"), None, "a publish into another device's topics");
        assert_eq!(t.parse_inbound("d/t1/dev1/ai/v1/dev1/other"), None);
        assert_eq!(t.parse_inbound("d/dev1/ai/v1/dev1/req"), None, "no tenant level");
        assert_eq!(t.parse_inbound("s/ai/v1/dev1/req"), None);
        assert!(t.valid_response_topic("dev1", "ai/v1/dev1/answers/7"));
        assert!(!t.valid_response_topic("dev1", "ai/v1/dev2/res/7"));
        assert!(!t.valid_response_topic("dev1", "ai/v1/dev1/req"));
        assert!(!t.valid_response_topic("dev1", "ai/v1/dev1/res/+"));
        assert!(!t.valid_response_topic("dev1", "ai/v1/dev1/"));
    }

    #[test]
    fn one_device_id_under_two_tenants_gets_two_subtrees() {
        let (a, b) = (mount_name("acme", "cam-1"), mount_name("globex", "cam-1"));
        assert_eq!(a, "acme/cam-1");
        assert_ne!(mount_topic(&a, "ai/v1/cam-1/res/r1"), mount_topic(&b, "ai/v1/cam-1/res/r1"));
        assert_eq!(unmount(&b, &mount_topic(&a, "ai/v1/cam-1/res/r1")), None);
        let sp = "ai/v1/shared/";
        assert_eq!(mount_filter(&b, sp, "#").unwrap(), "d/globex/cam-1/#");
        // A tenant name that is not a safe topic level is hashed; it still
        // takes exactly one level and never collides with a plain name.
        for t in ["a/b", "+", "#", "$x", "", &"t".repeat(65)] {
            let m = mount_name(t, "cam-1");
            assert!(m.starts_with('=') && m.matches('/').count() == 1 && !m.contains(['+', '#', '$']), "{m}");
        }
        assert_ne!(mount_name("a/b", "d"), mount_name("a+b", "d"));
        assert_eq!(device_of_mount(&mount_name("a/b", "cam-1")), "cam-1");
        assert_eq!(
            Topics::new("ai/v1").parse_inbound(&mount_topic(&mount_name("a/b", "c"), "ai/v1/c/req")).map(|x| x.0),
            Some(mount_name("a/b", "c").as_str())
        );
    }
}

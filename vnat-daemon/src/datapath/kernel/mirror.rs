//! This process's counted copy of the two NAT maps (see `KernelDatapath`).

use std::collections::HashMap as StdHashMap;
use std::net::IpAddr;

use vnat_common::{FlowKey, NatRewrite, NAT_F_LO_ADDR_OURS};

use super::{translate, translation_of};

/// A flow's ingress keys: one, or two while a move is under way.
pub(super) type ReverseKeys = smallvec::SmallVec<[FlowKey; 2]>;

#[derive(Default)]
pub(super) struct Mirror {
    pub(super) egress: StdHashMap<FlowKey, NatRewrite>,
    pub(super) ingress: StdHashMap<FlowKey, NatRewrite>,
    /// How many entries need each thing a translation sets up, so that
    /// releasing one is a lookup: egress translations whose local end
    /// moved, by its virtual address (kept on `lo`); ingress
    /// entries marked NAT_F_LO_ADDR_OURS, by the local virtual address they
    /// restore; entries of either map, by interface (the tc attachment).
    pub(super) local_moved: StdHashMap<IpAddr, usize>,
    pub(super) prepared_lo: StdHashMap<[u32; 4], usize>,
    pub(super) interfaces: StdHashMap<u32, usize>,
    /// The ingress keys of each flow (by its egress key): during a move
    /// there may be two (old and new placement). Held inline: a `Vec` is a
    /// 160-byte allocation per translated flow (issue 33, item 1).
    pub(super) reverse: StdHashMap<FlowKey, ReverseKeys>,
}

impl Mirror {
    pub(super) fn from(
        egress: Vec<(FlowKey, NatRewrite)>,
        ingress: Vec<(FlowKey, NatRewrite)>,
    ) -> Mirror {
        let mut m = Mirror::default();
        for (k, v) in egress {
            m.insert(true, k, v);
        }
        for (k, v) in ingress {
            m.insert(false, k, v);
        }
        m
    }

    pub(super) fn is_empty(&self) -> bool {
        self.egress.is_empty() && self.ingress.is_empty()
    }

    pub(super) fn insert(&mut self, egress: bool, key: FlowKey, value: NatRewrite) {
        self.remove(egress, &key);
        self.index(egress, &key, &value, true);
        if egress {
            self.egress.insert(key, value);
        } else {
            self.ingress.insert(key, value);
        }
    }

    pub(super) fn remove(&mut self, egress: bool, key: &FlowKey) {
        let old = if egress {
            self.egress.remove(key)
        } else {
            self.ingress.remove(key)
        };
        if let Some(v) = old {
            self.index(egress, key, &v, false);
        }
    }

    pub(super) fn index(&mut self, egress: bool, key: &FlowKey, v: &NatRewrite, add: bool) {
        fn step<K: std::hash::Hash + Eq>(m: &mut StdHashMap<K, usize>, k: K, add: bool) {
            if add {
                *m.entry(k).or_default() += 1;
            } else if let Some(n) = m.get_mut(&k) {
                *n -= 1;
                if *n == 0 {
                    m.remove(&k);
                }
            }
        }
        step(&mut self.interfaces, v.redirect_ifindex, add);
        if egress {
            if let Some(t) = translation_of(key, v) {
                if t.local_moved() {
                    step(&mut self.local_moved, t.flow.local.ip(), add);
                }
            }
            return;
        }
        let restored = translate::restored_key(key, v);
        if v.flags & NAT_F_LO_ADDR_OURS != 0 {
            step(&mut self.prepared_lo, restored.dst_addr_be, add);
        }
        let flow = restored.reversed();
        let keys = self.reverse.entry(flow).or_default();
        keys.retain(|k| k != key);
        if add {
            keys.push(*key);
        } else if keys.is_empty() {
            self.reverse.remove(&flow);
        }
    }
}

#[cfg(test)]
mod mirror_tests {
    use super::*;
    use crate::datapath::kernel::{pair_for, NatPair};
    use crate::datapath::{Proto, Translation, VirtualFlow};

    fn moved(local: &str, remote: &str, phys_local: &str, phys_remote: &str) -> Translation {
        Translation {
            flow: VirtualFlow {
                proto: Proto::Tcp,
                local: local.parse().unwrap(),
                remote: remote.parse().unwrap(),
            },
            physical_local: phys_local.parse().unwrap(),
            physical_remote: phys_remote.parse().unwrap(),
        }
    }

    fn add(m: &mut Mirror, p: &NatPair) {
        m.insert(false, p.ingress_key, p.ingress);
        m.insert(true, p.egress_key, p.egress);
    }

    #[test]
    fn counts_follow_inserts_replacements_and_removals() {
        let mut m = Mirror::default();
        // Two connections whose local end moved from 10.0.0.1 to 10.1.0.1,
        // and one whose peer moved from 10.0.0.9 to 10.2.0.9.
        let a = moved(
            "10.0.0.1:1000",
            "10.0.0.9:80",
            "10.1.0.1:1000",
            "10.0.0.9:80",
        );
        let b = moved(
            "10.0.0.1:1001",
            "10.0.0.9:80",
            "10.1.0.1:1001",
            "10.0.0.9:80",
        );
        let c = moved(
            "10.0.0.5:2000",
            "10.0.0.9:80",
            "10.0.0.5:2000",
            "10.2.0.9:80",
        );
        let (pa, pb, pc) = (
            pair_for(&a, 3, NAT_F_LO_ADDR_OURS),
            pair_for(&b, 3, NAT_F_LO_ADDR_OURS),
            pair_for(&c, 4, 0),
        );
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let words = |t: &Translation| {
            crate::datapath::flow_key(t.flow.proto, t.flow.local, t.flow.remote).src_addr_be
        };
        add(&mut m, &pa);
        add(&mut m, &pa); // written again: counted once
        add(&mut m, &pb);
        add(&mut m, &pc);
        assert_eq!(m.local_moved.get(&ip("10.0.0.1")), Some(&2));
        assert_eq!(m.prepared_lo.get(&words(&a)), Some(&2));
        assert_eq!(m.interfaces.get(&3), Some(&4));
        assert_eq!(m.interfaces.get(&4), Some(&2));
        assert_eq!(
            m.reverse.get(&a.flow.to_key()).map(|k| k.to_vec()),
            Some(vec![pa.ingress_key])
        );

        // `a` moves on to another interface: its old reverse entry stays
        // until the caller removes it, the new one is added.
        let a2 = moved(
            "10.0.0.1:1000",
            "10.0.0.9:80",
            "10.3.0.1:1000",
            "10.0.0.9:80",
        );
        let pa2 = pair_for(&a2, 5, NAT_F_LO_ADDR_OURS);
        add(&mut m, &pa2);
        assert_eq!(m.local_moved.get(&ip("10.0.0.1")), Some(&2));
        assert_eq!(m.reverse.get(&a.flow.to_key()).map(|k| k.len()), Some(2));
        m.remove(false, &pa.ingress_key);
        assert_eq!(
            m.reverse.get(&a.flow.to_key()).map(|k| k.to_vec()),
            Some(vec![pa2.ingress_key])
        );
        assert_eq!(m.interfaces.get(&3), Some(&2));
        assert_eq!(m.interfaces.get(&5), Some(&2));

        // Everything removed: nothing counted, nothing left behind.
        for p in [pa2, pb, pc] {
            m.remove(true, &p.egress_key);
            m.remove(false, &p.ingress_key);
        }
        m.remove(true, &pa.egress_key); // absent: no effect
        assert!(m.egress.is_empty() && m.ingress.is_empty());
        assert!(m.local_moved.is_empty());
        assert!(m.prepared_lo.is_empty() && m.interfaces.is_empty() && m.reverse.is_empty());
    }
}

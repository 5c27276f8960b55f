//! nf_tables over netlink (`NETLINK_NETFILTER`): the messages weft sends for its masquerade
//! tables and the replies it reads back. Pure bytes in, bytes out: the driver
//! ([`super`]) owns the socket.
//!
//! Contract:
//! - [`install`] is one batch (one nftables transaction, applied whole or not at all, never a
//!   moment without rules): for each wanted table `add table; delete table; add table` (the
//!   `nft -f` idiom for an atomic reload: the first add makes the delete safe when there is
//!   no table), its owner comment, its chains and rules; and a delete of each table of weft's
//!   no longer wanted. [`remove`] deletes tables. Every message asks for an ack.
//! - Rules are encoded as `nft` encodes them (a prefix match loads the prefix's bytes and
//!   masks the whole address for any other prefix), so `nft list` shows them as written; [`decode_rule`] reads
//!   back exactly what [`install`] writes, and anything else as `None`.
//! - Decoding never panics: a short or malformed message is an error or is skipped.

#![forbid(unsafe_code)]

use std::net::IpAddr;

use ipnet::IpNet;

use super::plan::{
    Action, Family, Hook, Match, Rule, SeenChain, SeenTable, TABLE, Table, owner_comment, owner_of,
};

const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFNL_MSG_BATCH_BEGIN: u16 = 0x10;
const NFNL_MSG_BATCH_END: u16 = 0x11;
const NFT_MSG_NEWTABLE: u16 = 0;
const NFT_MSG_GETTABLE: u16 = 1;
const NFT_MSG_DELTABLE: u16 = 2;
const NFT_MSG_NEWCHAIN: u16 = 3;
const NFT_MSG_GETCHAIN: u16 = 4;
const NFT_MSG_NEWRULE: u16 = 6;
const NFT_MSG_GETRULE: u16 = 7;

/// `NLMSG_ERROR`: an error or an ack.
pub(crate) const NLMSG_ERROR: u16 = 2;
/// `NLMSG_DONE`: the end of a dump.
pub(crate) const NLMSG_DONE: u16 = 3;

const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_DUMP: u16 = 0x300;
const NLM_F_CREATE: u16 = 0x400;
const NLM_F_APPEND: u16 = 0x800;
const NLA_F_NESTED: u16 = 0x8000;
const NLA_TYPE_MASK: u16 = 0x3fff;

const NFPROTO_IPV4: u8 = 2;
const NFPROTO_IPV6: u8 = 10;

const NFTA_TABLE_NAME: u16 = 1;
const NFTA_TABLE_USERDATA: u16 = 6;
const NFTA_CHAIN_TABLE: u16 = 1;
const NFTA_CHAIN_NAME: u16 = 3;
const NFTA_CHAIN_HOOK: u16 = 4;
const NFTA_CHAIN_POLICY: u16 = 5;
const NFTA_CHAIN_TYPE: u16 = 7;
const NFTA_HOOK_HOOKNUM: u16 = 1;
const NFTA_HOOK_PRIORITY: u16 = 2;
const NFTA_RULE_TABLE: u16 = 1;
const NFTA_RULE_CHAIN: u16 = 2;
const NFTA_RULE_EXPRESSIONS: u16 = 4;
const NFTA_LIST_ELEM: u16 = 1;
const NFTA_EXPR_NAME: u16 = 1;
const NFTA_EXPR_DATA: u16 = 2;
const NFTA_DATA_VALUE: u16 = 1;
const NFTA_DATA_VERDICT: u16 = 2;
const NFTA_VERDICT_CODE: u16 = 1;
const NFTA_PAYLOAD_DREG: u16 = 1;
const NFTA_PAYLOAD_BASE: u16 = 2;
const NFTA_PAYLOAD_OFFSET: u16 = 3;
const NFTA_PAYLOAD_LEN: u16 = 4;
const NFTA_CMP_SREG: u16 = 1;
const NFTA_CMP_OP: u16 = 2;
const NFTA_CMP_DATA: u16 = 3;
const NFTA_BITWISE_SREG: u16 = 1;
const NFTA_BITWISE_DREG: u16 = 2;
const NFTA_BITWISE_LEN: u16 = 3;
const NFTA_BITWISE_MASK: u16 = 4;
const NFTA_BITWISE_XOR: u16 = 5;
const NFTA_META_DREG: u16 = 1;
const NFTA_META_KEY: u16 = 2;
const NFTA_IMMEDIATE_DREG: u16 = 1;
const NFTA_IMMEDIATE_DATA: u16 = 2;
const NFTA_MASQ_FLAGS: u16 = 1;

const NFT_REG_VERDICT: u32 = 0;
const NFT_REG_1: u32 = 1;
const NFT_PAYLOAD_NETWORK_HEADER: u32 = 1;
const NFT_CMP_EQ: u32 = 0;
const NFT_CMP_NEQ: u32 = 1;
const NFT_META_MARK: u32 = 3;
const NF_ACCEPT: u32 = 1;
const NFT_RETURN: u32 = (-5i32) as u32;
const NF_NAT_RANGE_PROTO_RANDOM_FULLY: u32 = 1 << 4;
const NF_INET_FORWARD: u32 = 2;
const NF_INET_POST_ROUTING: u32 = 4;
const NF_IP_PRI_FILTER: i32 = 0;
const NF_IP_PRI_NAT_SRC: i32 = 100;
/// libnftnl's `NFTNL_UDATA_TABLE_COMMENT`: `nft list` shows it as the table's comment.
const UDATA_COMMENT: u8 = 0;

fn family_number(family: Family) -> u8 {
    match family {
        Family::Ip => NFPROTO_IPV4,
        Family::Ip6 => NFPROTO_IPV6,
    }
}

fn family_of_number(n: u8) -> Option<Family> {
    match n {
        NFPROTO_IPV4 => Some(Family::Ip),
        NFPROTO_IPV6 => Some(Family::Ip6),
        _ => None,
    }
}

/// Netlink attributes being written.
#[derive(Default)]
struct Attrs(Vec<u8>);

impl Attrs {
    fn bytes(&mut self, ty: u16, payload: &[u8]) -> &mut Self {
        let len = 4 + payload.len();
        self.0.extend_from_slice(&u16::try_from(len).unwrap_or(u16::MAX).to_ne_bytes());
        self.0.extend_from_slice(&ty.to_ne_bytes());
        self.0.extend_from_slice(payload);
        while !self.0.len().is_multiple_of(4) {
            self.0.push(0);
        }
        self
    }

    fn str(&mut self, ty: u16, s: &str) -> &mut Self {
        let mut v = s.as_bytes().to_vec();
        v.push(0);
        self.bytes(ty, &v)
    }

    fn be32(&mut self, ty: u16, v: u32) -> &mut Self {
        self.bytes(ty, &v.to_be_bytes())
    }

    fn nested(&mut self, ty: u16, f: impl FnOnce(&mut Attrs)) -> &mut Self {
        let mut inner = Attrs::default();
        f(&mut inner);
        self.bytes(ty | NLA_F_NESTED, &inner.0)
    }
}

/// A netlink message: header, `nfgenmsg`, attributes.
fn message(
    out: &mut Vec<u8>,
    ty: u16,
    flags: u16,
    seq: u32,
    family: u8,
    res_id: u16,
    attrs: &[u8],
) {
    let len = 16 + 4 + attrs.len();
    out.extend_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_ne_bytes());
    out.extend_from_slice(&ty.to_ne_bytes());
    out.extend_from_slice(&flags.to_ne_bytes());
    out.extend_from_slice(&seq.to_ne_bytes());
    out.extend_from_slice(&0u32.to_ne_bytes());
    out.push(family);
    out.push(0); // NFNETLINK_V0
    out.extend_from_slice(&res_id.to_be_bytes());
    out.extend_from_slice(attrs);
}

/// A batch being written: each message after `begin` gets the next sequence number and asks
/// for an ack.
struct Batch {
    buf: Vec<u8>,
    seq: u32,
    acks: Vec<u32>,
}

impl Batch {
    fn begin(seq: u32) -> Self {
        let mut buf = Vec::new();
        message(&mut buf, NFNL_MSG_BATCH_BEGIN, NLM_F_REQUEST, seq, 0, NFNL_SUBSYS_NFTABLES, &[]);
        Self { buf, seq, acks: Vec::new() }
    }

    fn add(&mut self, msg: u16, flags: u16, family: Family, attrs: &Attrs) {
        self.seq = self.seq.wrapping_add(1);
        let ty = (NFNL_SUBSYS_NFTABLES << 8) | msg;
        let flags = NLM_F_REQUEST | NLM_F_ACK | flags;
        message(&mut self.buf, ty, flags, self.seq, family_number(family), 0, &attrs.0);
        self.acks.push(self.seq);
    }

    fn end(mut self) -> Request {
        let seq = self.seq.wrapping_add(1);
        message(
            &mut self.buf,
            NFNL_MSG_BATCH_END,
            NLM_F_REQUEST,
            seq,
            0,
            NFNL_SUBSYS_NFTABLES,
            &[],
        );
        Request { bytes: self.buf, acks: self.acks }
    }
}

/// Bytes to send, and the sequence numbers whose acks say it was applied.
#[derive(Debug)]
pub(crate) struct Request {
    /// The batch.
    pub(crate) bytes: Vec<u8>,
    /// The sequence numbers that ask for an ack.
    pub(crate) acks: Vec<u32>,
}

fn table_attrs(comment: Option<&str>) -> Attrs {
    let mut a = Attrs::default();
    a.str(NFTA_TABLE_NAME, TABLE);
    if let Some(c) = comment {
        let mut ud = vec![UDATA_COMMENT, u8::try_from(c.len() + 1).unwrap_or(u8::MAX)];
        ud.extend_from_slice(c.as_bytes());
        ud.push(0);
        if ud.len() <= 2 + 255 {
            a.bytes(NFTA_TABLE_USERDATA, &ud);
        }
    }
    a
}

/// One transaction: the wanted tables written anew, `remove`'s deleted (see the module docs).
pub(crate) fn install(tables: &[Table], remove: &[Family], owner: &str, seq: u32) -> Request {
    let mut b = Batch::begin(seq);
    for table in tables {
        let f = table.family;
        b.add(NFT_MSG_NEWTABLE, NLM_F_CREATE, f, &table_attrs(None));
        b.add(NFT_MSG_DELTABLE, 0, f, &table_attrs(None));
        b.add(NFT_MSG_NEWTABLE, NLM_F_CREATE, f, &table_attrs(Some(&owner_comment(owner))));
        for chain in &table.chains {
            let (hooknum, priority, kind) = match chain.hook {
                Hook::Postrouting => (NF_INET_POST_ROUTING, NF_IP_PRI_NAT_SRC, "nat"),
                Hook::Forward => (NF_INET_FORWARD, NF_IP_PRI_FILTER, "filter"),
            };
            let mut a = Attrs::default();
            a.str(NFTA_CHAIN_TABLE, TABLE).str(NFTA_CHAIN_NAME, chain.hook.chain());
            a.nested(NFTA_CHAIN_HOOK, |h| {
                h.be32(NFTA_HOOK_HOOKNUM, hooknum).be32(NFTA_HOOK_PRIORITY, priority as u32);
            });
            a.be32(NFTA_CHAIN_POLICY, NF_ACCEPT).str(NFTA_CHAIN_TYPE, kind);
            b.add(NFT_MSG_NEWCHAIN, NLM_F_CREATE, f, &a);
            for rule in &chain.rules {
                let mut a = Attrs::default();
                a.str(NFTA_RULE_TABLE, TABLE).str(NFTA_RULE_CHAIN, chain.hook.chain());
                a.nested(NFTA_RULE_EXPRESSIONS, |list| encode_rule(list, rule));
                b.add(NFT_MSG_NEWRULE, NLM_F_CREATE | NLM_F_APPEND, f, &a);
            }
        }
    }
    for &f in remove {
        b.add(NFT_MSG_DELTABLE, 0, f, &table_attrs(None));
    }
    b.end()
}

/// One transaction deleting weft's tables of `families`.
pub(crate) fn remove(families: &[Family], seq: u32) -> Request {
    install(&[], families, "", seq)
}

/// A dump request for the tables, chains or rules of `family`.
pub(crate) fn dump(what: Dump, family: Family, seq: u32) -> Vec<u8> {
    let msg = match what {
        Dump::Tables => NFT_MSG_GETTABLE,
        Dump::Chains => NFT_MSG_GETCHAIN,
        Dump::Rules => NFT_MSG_GETRULE,
    };
    let mut out = Vec::new();
    let ty = (NFNL_SUBSYS_NFTABLES << 8) | msg;
    message(&mut out, ty, NLM_F_REQUEST | NLM_F_DUMP, seq, family_number(family), 0, &[]);
    out
}

/// What [`dump`] lists.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dump {
    /// Tables.
    Tables,
    /// Chains.
    Chains,
    /// Rules.
    Rules,
}

fn expr(list: &mut Attrs, name: &str, data: impl FnOnce(&mut Attrs)) {
    list.nested(NFTA_LIST_ELEM, |e| {
        e.str(NFTA_EXPR_NAME, name).nested(NFTA_EXPR_DATA, data);
    });
}

fn encode_cmp(list: &mut Attrs, negated: bool, value: &[u8]) {
    expr(list, "cmp", |d| {
        d.be32(NFTA_CMP_SREG, NFT_REG_1)
            .be32(NFTA_CMP_OP, if negated { NFT_CMP_NEQ } else { NFT_CMP_EQ })
            .nested(NFTA_CMP_DATA, |v| {
                v.bytes(NFTA_DATA_VALUE, value);
            });
    });
}

fn encode_bitwise(list: &mut Attrs, mask: &[u8]) {
    expr(list, "bitwise", |d| {
        d.be32(NFTA_BITWISE_SREG, NFT_REG_1)
            .be32(NFTA_BITWISE_DREG, NFT_REG_1)
            .be32(NFTA_BITWISE_LEN, mask.len() as u32)
            .nested(NFTA_BITWISE_MASK, |v| {
                v.bytes(NFTA_DATA_VALUE, mask);
            })
            .nested(NFTA_BITWISE_XOR, |v| {
                v.bytes(NFTA_DATA_VALUE, &vec![0; mask.len()]);
            });
    });
}

/// The header offset of a family's source (or destination) address, and its length.
fn addr_field(v4: bool, source: bool) -> (u32, usize) {
    match (v4, source) {
        (true, true) => (12, 4),
        (true, false) => (16, 4),
        (false, true) => (8, 16),
        (false, false) => (24, 16),
    }
}

fn addr_bytes(ip: IpAddr) -> Vec<u8> {
    match ip {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    }
}

fn encode_rule(list: &mut Attrs, rule: &Rule) {
    for m in &rule.matches {
        match *m {
            Match::Mark(mask) => {
                expr(list, "meta", |d| {
                    d.be32(NFTA_META_KEY, NFT_META_MARK).be32(NFTA_META_DREG, NFT_REG_1);
                });
                encode_bitwise(list, &mask.to_ne_bytes());
                encode_cmp(list, false, &mask.to_ne_bytes());
            }
            Match::Saddr { net, negated } | Match::Daddr { net, negated } => {
                let source = matches!(m, Match::Saddr { .. });
                let (offset, full) = addr_field(net.addr().is_ipv4(), source);
                let prefix = usize::from(net.prefix_len());
                // As nft: a prefix of whole bytes loads those bytes; any other the whole
                // address, masked.
                let len = if prefix % 8 == 0 && prefix > 0 { prefix / 8 } else { full };
                expr(list, "payload", |d| {
                    d.be32(NFTA_PAYLOAD_DREG, NFT_REG_1)
                        .be32(NFTA_PAYLOAD_BASE, NFT_PAYLOAD_NETWORK_HEADER)
                        .be32(NFTA_PAYLOAD_OFFSET, offset)
                        .be32(NFTA_PAYLOAD_LEN, len as u32);
                });
                let mask = addr_bytes(net.netmask());
                if prefix % 8 != 0 || prefix == 0 {
                    encode_bitwise(list, &mask[..len]);
                }
                encode_cmp(list, negated, &addr_bytes(net.network())[..len]);
            }
        }
    }
    match rule.action {
        Action::Return | Action::Accept => {
            let code = if rule.action == Action::Return { NFT_RETURN } else { NF_ACCEPT };
            expr(list, "immediate", |d| {
                d.be32(NFTA_IMMEDIATE_DREG, NFT_REG_VERDICT).nested(NFTA_IMMEDIATE_DATA, |v| {
                    v.nested(NFTA_DATA_VERDICT, |verdict| {
                        verdict.be32(NFTA_VERDICT_CODE, code);
                    });
                });
            });
        }
        Action::Masquerade { fully_random } => expr(list, "masq", |d| {
            if fully_random {
                d.be32(NFTA_MASQ_FLAGS, NF_NAT_RANGE_PROTO_RANDOM_FULLY);
            }
        }),
    }
}

/// Why a reply could not be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum DecodeError {
    /// A message shorter than its header says, or than a header.
    #[error("a truncated netlink message")]
    Truncated,
}

/// One netlink message of a reply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Msg<'a> {
    /// Its type.
    pub(crate) ty: u16,
    /// Its sequence number.
    pub(crate) seq: u32,
    /// What follows the header.
    pub(crate) payload: &'a [u8],
}

impl Msg<'_> {
    /// For `NLMSG_ERROR`: the error (0: an ack; else a negative errno) and the sequence
    /// number of the message it answers.
    pub(crate) fn error(&self) -> Option<i32> {
        (self.ty == NLMSG_ERROR).then(|| {
            self.payload
                .get(..4)
                .map_or(-libc::EBADMSG, |b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
        })
    }
}

/// The messages in a datagram.
pub(crate) fn messages(mut buf: &[u8]) -> Result<Vec<Msg<'_>>, DecodeError> {
    let mut out = Vec::new();
    while buf.len() >= 16 {
        let len = u32::from_ne_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
        if len < 16 || len > buf.len() {
            return Err(DecodeError::Truncated);
        }
        out.push(Msg {
            ty: u16::from_ne_bytes([buf[4], buf[5]]),
            seq: u32::from_ne_bytes([buf[8], buf[9], buf[10], buf[11]]),
            payload: &buf[16..len],
        });
        buf = &buf[len.next_multiple_of(4).min(buf.len())..];
    }
    Ok(out)
}

/// Attributes read: (type without flags, payload).
type AttrList<'a> = Vec<(u16, &'a [u8])>;

/// The attributes in `buf`: (type without flags, payload); a malformed tail is dropped.
fn attrs(mut buf: &[u8]) -> Vec<(u16, &[u8])> {
    let mut out = Vec::new();
    while buf.len() >= 4 {
        let len = usize::from(u16::from_ne_bytes([buf[0], buf[1]]));
        let ty = u16::from_ne_bytes([buf[2], buf[3]]) & NLA_TYPE_MASK;
        if len < 4 || len > buf.len() {
            break;
        }
        out.push((ty, &buf[4..len]));
        buf = &buf[len.next_multiple_of(4).min(buf.len())..];
    }
    out
}

fn attr<'a>(list: &[(u16, &'a [u8])], ty: u16) -> Option<&'a [u8]> {
    list.iter().find(|(t, _)| *t == ty).map(|(_, p)| *p)
}

fn attr_str(list: &[(u16, &[u8])], ty: u16) -> Option<String> {
    let b = attr(list, ty)?;
    let b = b.split(|&c| c == 0).next().unwrap_or(b);
    Some(String::from_utf8_lossy(b).into_owned())
}

fn attr_be32(list: &[(u16, &[u8])], ty: u16) -> Option<u32> {
    let b = attr(list, ty)?;
    Some(u32::from_be_bytes(b.get(..4)?.try_into().ok()?))
}

fn data_value(list: &[(u16, &[u8])], ty: u16) -> Option<Vec<u8>> {
    attr(&attrs(attr(list, ty)?), NFTA_DATA_VALUE).map(<[u8]>::to_vec)
}

/// A message's family and attributes (after `nfgenmsg`), if it is an nf_tables message of
/// type `msg`.
fn nft_body<'a>(m: &Msg<'a>, msg: u16) -> Option<(Family, AttrList<'a>)> {
    if m.ty != (NFNL_SUBSYS_NFTABLES << 8) | msg || m.payload.len() < 4 {
        return None;
    }
    Some((family_of_number(m.payload[0])?, attrs(&m.payload[4..])))
}

/// A table of a dump: its family, name and comment.
pub(crate) fn decode_table(m: &Msg<'_>) -> Option<(Family, String, Option<String>)> {
    let (family, a) = nft_body(m, NFT_MSG_NEWTABLE)?;
    let name = attr_str(&a, NFTA_TABLE_NAME)?;
    let comment = attr(&a, NFTA_TABLE_USERDATA).and_then(|ud| {
        // TLVs: type, length, value.
        let mut rest = ud;
        while rest.len() >= 2 {
            let (t, l) = (rest[0], usize::from(rest[1]));
            let v = rest.get(2..2 + l)?;
            if t == UDATA_COMMENT {
                let v = v.split(|&c| c == 0).next().unwrap_or(v);
                return Some(String::from_utf8_lossy(v).into_owned());
            }
            rest = &rest[2 + l..];
        }
        None
    });
    Some((family, name, comment))
}

/// A chain of a dump: its family, table, name, and which of weft's hooks it is exactly.
pub(crate) fn decode_chain(m: &Msg<'_>) -> Option<(Family, String, String, Option<Hook>)> {
    let (family, a) = nft_body(m, NFT_MSG_NEWCHAIN)?;
    let table = attr_str(&a, NFTA_CHAIN_TABLE)?;
    let name = attr_str(&a, NFTA_CHAIN_NAME)?;
    let hook = attr(&a, NFTA_CHAIN_HOOK).and_then(|h| {
        let h = attrs(h);
        let num = attr_be32(&h, NFTA_HOOK_HOOKNUM)?;
        let prio = attr_be32(&h, NFTA_HOOK_PRIORITY)? as i32;
        let kind = attr_str(&a, NFTA_CHAIN_TYPE)?;
        let policy = attr_be32(&a, NFTA_CHAIN_POLICY).unwrap_or(NF_ACCEPT);
        match (num, prio, kind.as_str(), policy) {
            (NF_INET_POST_ROUTING, NF_IP_PRI_NAT_SRC, "nat", NF_ACCEPT) => Some(Hook::Postrouting),
            (NF_INET_FORWARD, NF_IP_PRI_FILTER, "filter", NF_ACCEPT) => Some(Hook::Forward),
            _ => None,
        }
    });
    Some((family, table, name, hook))
}

/// A rule of a dump: its family, table, chain, and the rule if it is one weft writes.
pub(crate) fn decode_rule(m: &Msg<'_>) -> Option<(Family, String, String, Option<Rule>)> {
    let (family, a) = nft_body(m, NFT_MSG_NEWRULE)?;
    let table = attr_str(&a, NFTA_RULE_TABLE)?;
    let chain = attr_str(&a, NFTA_RULE_CHAIN)?;
    let rule = attr(&a, NFTA_RULE_EXPRESSIONS).and_then(|e| read_rule(family, e));
    Some((family, table, chain, rule))
}

/// What a register holds while a rule is read.
enum Loaded {
    Nothing,
    Mark,
    Addr { source: bool, len: usize },
}

fn read_rule(family: Family, exprs: &[u8]) -> Option<Rule> {
    let v4 = family == Family::Ip;
    let mut matches = Vec::new();
    let mut loaded = Loaded::Nothing;
    let mut mask: Option<Vec<u8>> = None;
    let mut action = None;
    for (ty, elem) in attrs(exprs) {
        if ty != NFTA_LIST_ELEM || action.is_some() {
            return None;
        }
        let e = attrs(elem);
        let name = attr_str(&e, NFTA_EXPR_NAME)?;
        let d = attrs(attr(&e, NFTA_EXPR_DATA).unwrap_or(&[]));
        match name.as_str() {
            "meta" => {
                (attr_be32(&d, NFTA_META_KEY)? == NFT_META_MARK).then_some(())?;
                (attr_be32(&d, NFTA_META_DREG)? == NFT_REG_1).then_some(())?;
                loaded = Loaded::Mark;
                mask = None;
            }
            "payload" => {
                (attr_be32(&d, NFTA_PAYLOAD_BASE)? == NFT_PAYLOAD_NETWORK_HEADER).then_some(())?;
                (attr_be32(&d, NFTA_PAYLOAD_DREG)? == NFT_REG_1).then_some(())?;
                let offset = attr_be32(&d, NFTA_PAYLOAD_OFFSET)?;
                let len = attr_be32(&d, NFTA_PAYLOAD_LEN)? as usize;
                let source = [true, false].into_iter().find(|&s| addr_field(v4, s).0 == offset)?;
                (len >= 1 && len <= addr_field(v4, source).1).then_some(())?;
                loaded = Loaded::Addr { source, len };
                mask = None;
            }
            "bitwise" => {
                (attr_be32(&d, NFTA_BITWISE_SREG)? == NFT_REG_1).then_some(())?;
                (attr_be32(&d, NFTA_BITWISE_DREG)? == NFT_REG_1).then_some(())?;
                let xor = data_value(&d, NFTA_BITWISE_XOR)?;
                xor.iter().all(|&b| b == 0).then_some(())?;
                mask = Some(data_value(&d, NFTA_BITWISE_MASK)?);
            }
            "cmp" => {
                (attr_be32(&d, NFTA_CMP_SREG)? == NFT_REG_1).then_some(())?;
                let negated = match attr_be32(&d, NFTA_CMP_OP)? {
                    NFT_CMP_EQ => false,
                    NFT_CMP_NEQ => true,
                    _ => return None,
                };
                let value = data_value(&d, NFTA_CMP_DATA)?;
                match std::mem::replace(&mut loaded, Loaded::Nothing) {
                    Loaded::Nothing => return None,
                    Loaded::Mark => {
                        let v = u32::from_ne_bytes(value.as_slice().try_into().ok()?);
                        let m = u32::from_ne_bytes(mask.take()?.as_slice().try_into().ok()?);
                        (!negated && v == m).then_some(())?;
                        matches.push(Match::Mark(m));
                    }
                    Loaded::Addr { source, len } => {
                        let net = read_prefix(v4, len, mask.take(), &value)?;
                        matches.push(if source {
                            Match::Saddr { net, negated }
                        } else {
                            Match::Daddr { net, negated }
                        });
                    }
                }
            }
            "immediate" => {
                (attr_be32(&d, NFTA_IMMEDIATE_DREG)? == NFT_REG_VERDICT).then_some(())?;
                let v = attrs(attr(&d, NFTA_IMMEDIATE_DATA)?);
                let code = attr_be32(&attrs(attr(&v, NFTA_DATA_VERDICT)?), NFTA_VERDICT_CODE)?;
                action = Some(match code {
                    NF_ACCEPT => Action::Accept,
                    NFT_RETURN => Action::Return,
                    _ => return None,
                });
            }
            "masq" => {
                let flags = attr_be32(&d, NFTA_MASQ_FLAGS).unwrap_or(0);
                (flags & !NF_NAT_RANGE_PROTO_RANDOM_FULLY == 0).then_some(())?;
                (d.iter().all(|(t, _)| *t == NFTA_MASQ_FLAGS)).then_some(())?;
                action = Some(Action::Masquerade {
                    fully_random: flags & NF_NAT_RANGE_PROTO_RANDOM_FULLY != 0,
                });
            }
            _ => return None,
        }
    }
    if !matches!(loaded, Loaded::Nothing) {
        return None;
    }
    Some(Rule { matches, action: action? })
}

/// The prefix a load of `len` bytes, masked by `mask` (all ones when `None`), compared with
/// `value`, matches; `None` unless the mask is a prefix and the value has no host bits.
fn read_prefix(v4: bool, len: usize, mask: Option<Vec<u8>>, value: &[u8]) -> Option<IpNet> {
    let mask = mask.unwrap_or_else(|| vec![0xff; len]);
    if mask.len() != len || value.len() != len {
        return None;
    }
    let bits: u32 = mask.iter().map(|b| b.count_ones()).sum();
    let contiguous = mask.iter().enumerate().all(|(i, &b)| {
        let want = bits.saturating_sub(8 * i as u32).min(8);
        b == (0xffu16 << (8 - want)) as u8
    });
    if !contiguous || value.iter().zip(&mask).any(|(v, m)| v & !m != 0) {
        return None;
    }
    let full = if v4 { 4 } else { 16 };
    let mut addr = value.to_vec();
    addr.resize(full, 0);
    let ip: IpAddr = if v4 {
        std::net::Ipv4Addr::from(<[u8; 4]>::try_from(addr.as_slice()).ok()?).into()
    } else {
        std::net::Ipv6Addr::from(<[u8; 16]>::try_from(addr.as_slice()).ok()?).into()
    };
    IpNet::new(ip, u8::try_from(bits).ok()?).ok()
}

/// weft's tables among a dump's tables, chains and rules (messages of any other table are
/// ignored), for [`super::plan::plan`].
pub(crate) fn seen_tables(
    tables: &[(Family, String, Option<String>)],
    chains: &[(Family, String, String, Option<Hook>)],
    rules: &[(Family, String, String, Option<Rule>)],
) -> Vec<SeenTable> {
    let mut out = Vec::new();
    for (family, name, comment) in tables {
        if name != TABLE {
            continue;
        }
        let chains = chains
            .iter()
            .filter(|(f, t, _, _)| f == family && t == TABLE)
            .map(|(_, _, name, hook)| SeenChain {
                name: name.clone(),
                hook: *hook,
                rules: rules
                    .iter()
                    .filter(|(f, t, c, _)| f == family && t == TABLE && c == name)
                    .map(|(_, _, _, r)| r.clone())
                    .collect(),
            })
            .collect();
        out.push(SeenTable {
            family: *family,
            owner: comment.as_deref().and_then(owner_of).map(str::to_owned),
            chains,
        });
    }
    out.sort_by_key(|t| t.family);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataplane::masq::plan::{Inputs, wanted};

    fn inputs() -> Inputs {
        Inputs {
            network: Some("10.244.0.0/16".parse().unwrap()),
            subnet: Some("10.244.3.0/24".parse().unwrap()),
            network6: Some("fd00:10:244::/56".parse().unwrap()),
            subnet6: Some("fd00:10:244:3::/64".parse().unwrap()),
            random_fully: true,
            forward: true,
        }
    }

    /// Every rule weft writes reads back as itself: what the kernel dumps is what was sent
    /// (the message type aside), so a read-back equals the wanted rule.
    #[test]
    fn every_rule_reads_back_as_itself() {
        for random_fully in [true, false] {
            for table in wanted(&Inputs { random_fully, ..inputs() }) {
                for chain in &table.chains {
                    for rule in &chain.rules {
                        let mut list = Attrs::default();
                        encode_rule(&mut list, rule);
                        assert_eq!(read_rule(table.family, &list.0).as_ref(), Some(rule), "{rule}");
                    }
                }
            }
        }
        // Odd prefixes: a partial byte is masked.
        for net in ["10.240.0.0/13", "10.0.0.0/8", "0.0.0.0/0", "10.244.3.128/25"] {
            let rule = Rule {
                matches: vec![Match::Daddr { net: net.parse().unwrap(), negated: true }],
                action: Action::Return,
            };
            let mut list = Attrs::default();
            encode_rule(&mut list, &rule);
            assert_eq!(read_rule(Family::Ip, &list.0), Some(rule), "{net}");
        }
    }

    /// Prefixes load as nft loads them, so `nft list` prints them as prefixes: a whole-byte
    /// prefix its bytes, any other the whole address, masked.
    #[test]
    fn prefixes_load_as_nft_loads_them() {
        for (net, len, masked) in
            [("10.244.0.0/16", 2, false), ("224.0.0.0/4", 4, true), ("ff00::/8", 1, false)]
        {
            let rule = Rule {
                matches: vec![Match::Daddr { net: net.parse().unwrap(), negated: true }],
                action: Action::Return,
            };
            let mut list = Attrs::default();
            encode_rule(&mut list, &rule);
            let exprs: Vec<(String, AttrList<'_>)> = attrs(&list.0)
                .into_iter()
                .map(|(_, e)| {
                    let e = attrs(e);
                    let name = attr_str(&e, NFTA_EXPR_NAME).unwrap();
                    (name, attrs(attr(&e, NFTA_EXPR_DATA).unwrap_or(&[])))
                })
                .collect();
            let payload = &exprs.iter().find(|(n, _)| n == "payload").unwrap().1;
            assert_eq!(attr_be32(payload, NFTA_PAYLOAD_LEN), Some(len), "{net}");
            assert_eq!(exprs.iter().any(|(n, _)| n == "bitwise"), masked, "{net}");
        }
    }

    /// A rule weft does not write (another expression, a verdict it does not use, an address
    /// read in the other family's place) is `None`, never a wanted rule.
    #[test]
    fn foreign_rules_read_as_none() {
        let mut list = Attrs::default();
        expr(&mut list, "counter", |_| {});
        assert_eq!(read_rule(Family::Ip, &list.0), None);
        let rule = Rule {
            matches: vec![Match::Saddr { net: "10.244.0.0/16".parse().unwrap(), negated: false }],
            action: Action::Accept,
        };
        let mut list = Attrs::default();
        encode_rule(&mut list, &rule);
        assert_eq!(read_rule(Family::Ip6, &list.0), None, "offset 12 is no ip6 address");
        let mut with_counter = Attrs(list.0.clone());
        expr(&mut with_counter, "counter", |_| {});
        assert_eq!(read_rule(Family::Ip, &with_counter.0), None);
        assert_eq!(read_rule(Family::Ip, &[]), None, "no verdict");
        assert_eq!(read_rule(Family::Ip, &[1, 2, 3]), None);
    }

    /// The batch: begin, three table messages per family, chains and rules, end; one ack per
    /// message between; the dump of it decodes to what was wanted.
    #[test]
    fn an_install_is_one_batch_that_decodes_to_the_wanted_tables() {
        let tables = wanted(&inputs());
        let req = install(&tables, &[], "n1", 100);
        let msgs = messages(&req.bytes).unwrap();
        assert_eq!(msgs.first().map(|m| m.ty), Some(NFNL_MSG_BATCH_BEGIN));
        assert_eq!(msgs.last().map(|m| m.ty), Some(NFNL_MSG_BATCH_END));
        // 2 families x (3 table + 2 chains + 8 rules).
        assert_eq!(req.acks.len(), 26);
        assert_eq!(req.acks, (101..127).collect::<Vec<u32>>());
        // What the kernel would list back: the NEW* messages after the delete.
        let inner = &msgs[1..msgs.len() - 1];
        let t: Vec<_> = inner.iter().filter_map(decode_table).filter(|t| t.2.is_some()).collect();
        let c: Vec<_> = inner.iter().filter_map(decode_chain).collect();
        let r: Vec<_> = inner.iter().filter_map(decode_rule).collect();
        assert_eq!(t[0], (Family::Ip, "weft".to_owned(), Some("weft node n1".to_owned())));
        let seen = seen_tables(&t, &c, &r);
        assert_eq!(
            crate::dataplane::masq::plan::plan(&tables, &seen, "n1"),
            crate::dataplane::masq::plan::Plan::Nothing
        );
        // Removal: deletes only.
        let req = remove(&[Family::Ip6], 7);
        let msgs = messages(&req.bytes).unwrap();
        assert_eq!(msgs.len(), 3);
        assert_eq!(msgs[1].ty, (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_DELTABLE);
        assert_eq!(msgs[1].payload[0], NFPROTO_IPV6);
    }

    #[test]
    fn malformed_replies_never_panic() {
        assert_eq!(messages(&[0; 3]).unwrap(), []);
        assert_eq!(
            messages(&[200, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]),
            Err(DecodeError::Truncated)
        );
        let err = Msg { ty: NLMSG_ERROR, seq: 1, payload: &(-1i32).to_ne_bytes() };
        assert_eq!(err.error(), Some(-1));
        assert_eq!(Msg { ty: NLMSG_ERROR, seq: 1, payload: &[] }.error(), Some(-libc::EBADMSG));
        for len in 0..40 {
            let m = Msg {
                ty: (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWTABLE,
                seq: 0,
                payload: &[2; 40][..len],
            };
            let _ = decode_table(&m);
            let _ = decode_chain(&m);
            let _ = decode_rule(&m);
        }
    }
}

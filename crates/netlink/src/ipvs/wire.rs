//! IPVS's generic netlink numbers (`include/uapi/linux/ip_vs.h`): commands and attribute types. The framing
//! they are written and read with is the crate's one netlink framing, [`crate::wire`], re-exported here so the
//! IPVS code names both as `wire::...`.

pub(crate) use crate::wire::*;

/// The generic netlink version IPVS speaks.
pub(crate) const IPVS_GENL_VERSION: u8 = 1;

// IPVS_CMD_*.
pub(crate) const CMD_NEW_SERVICE: u8 = 1;
pub(crate) const CMD_SET_SERVICE: u8 = 2;
pub(crate) const CMD_DEL_SERVICE: u8 = 3;
pub(crate) const CMD_GET_SERVICE: u8 = 4;
pub(crate) const CMD_NEW_DEST: u8 = 5;
pub(crate) const CMD_SET_DEST: u8 = 6;
pub(crate) const CMD_DEL_DEST: u8 = 7;
pub(crate) const CMD_GET_DEST: u8 = 8;
pub(crate) const CMD_SET_CONFIG: u8 = 12;
pub(crate) const CMD_GET_CONFIG: u8 = 13;
pub(crate) const CMD_GET_INFO: u8 = 15;
pub(crate) const CMD_ZERO: u8 = 16;
pub(crate) const CMD_FLUSH: u8 = 17;

// IPVS_CMD_ATTR_*.
pub(crate) const CMD_ATTR_SERVICE: u16 = 1;
pub(crate) const CMD_ATTR_DEST: u16 = 2;
pub(crate) const CMD_ATTR_TIMEOUT_TCP: u16 = 4;
pub(crate) const CMD_ATTR_TIMEOUT_TCP_FIN: u16 = 5;
pub(crate) const CMD_ATTR_TIMEOUT_UDP: u16 = 6;

// IPVS_SVC_ATTR_*.
pub(crate) const SVC_AF: u16 = 1;
pub(crate) const SVC_PROTOCOL: u16 = 2;
pub(crate) const SVC_ADDR: u16 = 3;
pub(crate) const SVC_PORT: u16 = 4;
pub(crate) const SVC_FWMARK: u16 = 5;
pub(crate) const SVC_SCHED_NAME: u16 = 6;
pub(crate) const SVC_FLAGS: u16 = 7;
pub(crate) const SVC_TIMEOUT: u16 = 8;
pub(crate) const SVC_NETMASK: u16 = 9;
pub(crate) const SVC_STATS: u16 = 10;
pub(crate) const SVC_PE_NAME: u16 = 11;
pub(crate) const SVC_STATS64: u16 = 12;

// IPVS_DEST_ATTR_*.
pub(crate) const DEST_ADDR: u16 = 1;
pub(crate) const DEST_PORT: u16 = 2;
pub(crate) const DEST_FWD_METHOD: u16 = 3;
pub(crate) const DEST_WEIGHT: u16 = 4;
pub(crate) const DEST_U_THRESH: u16 = 5;
pub(crate) const DEST_L_THRESH: u16 = 6;
pub(crate) const DEST_ACTIVE_CONNS: u16 = 7;
pub(crate) const DEST_INACT_CONNS: u16 = 8;
pub(crate) const DEST_PERSIST_CONNS: u16 = 9;
pub(crate) const DEST_STATS: u16 = 10;
pub(crate) const DEST_ADDR_FAMILY: u16 = 11;
pub(crate) const DEST_STATS64: u16 = 12;
pub(crate) const DEST_TUN_TYPE: u16 = 13;
pub(crate) const DEST_TUN_PORT: u16 = 14;
pub(crate) const DEST_TUN_FLAGS: u16 = 15;

// IPVS_INFO_ATTR_*.
pub(crate) const INFO_VERSION: u16 = 1;
pub(crate) const INFO_CONN_TAB_SIZE: u16 = 2;

"""HCCL rank tables (JSON v1.0, Ascend 910): load, validate, generate, merge, find local devices.

A rank table tells HCCL which devices take part in a job and the address of each one::

    {"version": "1.0", "server_count": "1",
     "server_list": [{"server_id": "10.155.111.140",
                      "device": [{"device_id": "0", "device_ip": "192.168.100.101",
                                  "rank_id": "0"}, ...],
                      "host_nic_ip": "reserve"}],
     "status": "completed"}

Every value is a string. An Ascend 910 server holds 8 devices in two groups of four
(0-3 and 4-7); HCCL runs 1, 2, 4 or 8 ranks on a server, a 2- or 4-device server stays
inside one group, and every server of a job runs the same number of ranks.

The same checks serve the `model-zoo rank-table` command (generate / validate / merge /
devices) and the launch scripts, which ask `devices` for this server's DEVICE_ID/RANK_ID
pairs. Only the standard library is used, so none of this needs MindSpore.
"""

import ipaddress
import json
import os
import re
import shutil
import socket
import subprocess

from model_zoo.errors import UserInputError
from model_zoo.files import write_json_atomically

SUPPORTED_VERSION = "1.0"
TOP_LEVEL_FIELDS = ("version", "server_count", "server_list", "status")
SERVER_FIELDS = ("server_id", "device")
OPTIONAL_SERVER_FIELDS = ("host_nic_ip",)
DEVICE_FIELDS = ("device_id", "device_ip", "rank_id")
DEVICES_PER_SERVER = 8
GROUP_SIZE = 4  # devices 0-3 and 4-7 form the two groups of an Ascend 910 server
ALLOWED_DEVICES_PER_SERVER = (1, 2, 4, 8)
DEFAULT_HCCN_CONF = "/etc/hccn.conf"

_DIGITS = re.compile(r"[0-9]+")
_RANGE = re.compile(r"\s*\[\s*(\d+)\s*,\s*(\d+)\s*\)\s*")
_ADDRESS_LINE = re.compile(r"address_(\d+)\s*=\s*(\S*)\s*")
_INET = re.compile(r"\binet\s+(\d+\.\d+\.\d+\.\d+)")


class RankTableError(UserInputError):
    """A rank table (or what it is built from) is wrong.

    `problems` holds every problem found, each naming the server, device and field; the
    message is one line: the source followed by the problems separated by "; ".
    """

    def __init__(self, source: str, problems):
        if isinstance(problems, str):
            problems = [problems]
        self.source = source
        self.problems = list(problems)
        if len(self.problems) == 1:
            message = f"{source}: {self.problems[0]}"
        else:
            message = f"{source}: {len(self.problems)} problems: " + "; ".join(self.problems)
        super().__init__(message)


# --------------------------------------------------------------------------- loading


def load_rank_table(path) -> dict:
    """Read a rank table JSON file.

    Raises:
        RankTableError: the file is missing or unreadable, is not JSON (line and column
            given), or does not hold a JSON object.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise RankTableError(path, "rank table file not found")
    if os.path.isdir(path):
        raise RankTableError(path, "is a directory, not a rank table JSON file")
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except (OSError, UnicodeDecodeError) as err:
        raise RankTableError(path, f"cannot read the rank table: {err}") from None
    try:
        table = json.loads(text)
    except json.JSONDecodeError as err:
        raise RankTableError(path, f"not valid JSON at line {err.lineno} column {err.colno}: "
                                   f"{err.msg}") from None
    if not isinstance(table, dict):
        raise RankTableError(path, f"a rank table must be a JSON object, got "
                                   f"{_json_type(table)}")
    return table


# --------------------------------------------------------------------------- validation


def validate_rank_table(table, device_num=None, source="<table>") -> list:
    """Check a rank table against the HCCL v1.0 format and the Ascend 910 device rules.

    Args:
        table: the parsed JSON (a dict).
        device_num: if given, the total number of devices the job expects.
        source: how messages name the table (usually its file path).

    Returns:
        An empty list: the table is valid.

    Raises:
        RankTableError: listing every problem found, each naming the server (index and
            server_id), the device (index and device_id) and the field.
    """
    problems = []
    if not isinstance(table, dict):
        raise RankTableError(source, f"a rank table must be a JSON object, got "
                                     f"{_json_type(table)}")

    missing = [field for field in TOP_LEVEL_FIELDS if field not in table]
    if missing:
        problems.append("missing top-level field" + _plural(missing) + ": "
                        + ", ".join(missing))
    extra = [field for field in table if field not in TOP_LEVEL_FIELDS]
    if extra:
        problems.append("unexpected top-level field" + _plural(extra) + ": "
                        + ", ".join(map(str, extra)) + " (v1.0 has "
                        + ", ".join(TOP_LEVEL_FIELDS) + ")")

    if "version" in table:
        version = table["version"]
        if not isinstance(version, str):
            problems.append(f"version must be a string, got {_describe(version)}")
        elif version != SUPPORTED_VERSION:
            # Other versions (1.2 with super_device_id, 2.0 ...) are laid out differently:
            # checking their servers against v1.0 rules would only produce noise.
            problems.append(f"unsupported version {version!r}: this validates rank table "
                            f"version \"{SUPPORTED_VERSION}\" (v1.0) only")
            raise RankTableError(source, problems)

    if "status" in table:
        status = table["status"]
        if not isinstance(status, str):
            problems.append(f"status must be a string, got {_describe(status)}")
        elif status != "completed":
            problems.append(f"status is {status!r}, must be \"completed\"")

    servers = table.get("server_list")
    if "server_list" in table:
        if not isinstance(servers, list):
            problems.append(f"server_list must be a list of servers, got {_json_type(servers)}")
            servers = None
        elif not servers:
            problems.append("server_list is empty: a rank table needs at least one server")

    if "server_count" in table:
        count = table["server_count"]
        if not isinstance(count, str):
            problems.append(f"server_count must be a string, got {_describe(count)}")
        elif not _DIGITS.fullmatch(count):
            problems.append(f"server_count {count!r} is not a whole number")
        elif servers is not None and int(count) != len(servers):
            problems.append(f"server_count is {count!r} but server_list has {len(servers)} "
                            f"server{'s' if len(servers) != 1 else ''}")

    if servers:
        problems.extend(_check_servers(servers, device_num))
    if problems:
        raise RankTableError(source, problems)
    return []


def _check_servers(servers, device_num):
    problems = []
    server_ids = {}         # server_id -> first place it was seen
    device_ips = {}         # device_ip -> first place it was seen
    rank_ids = {}           # rank int -> first place it was seen
    counts = []             # (place, device count) for servers with a usable device list
    total_devices = 0
    for index, server in enumerate(servers):
        if not isinstance(server, dict):
            problems.append(f"server_list[{index}] must be an object, got {_json_type(server)}")
            continue
        server_id = server.get("server_id")
        place = f"server_list[{index}]" + (f" (server_id {server_id})"
                                           if isinstance(server_id, str) else "")
        missing = [field for field in SERVER_FIELDS if field not in server]
        if missing:
            problems.append(f"{place}: missing field{_plural(missing)} {', '.join(missing)}")
        extra = [field for field in server if field not in SERVER_FIELDS + OPTIONAL_SERVER_FIELDS]
        if extra:
            problems.append(f"{place}: unexpected field{_plural(extra)} "
                            f"{', '.join(map(str, extra))} (not part of v1.0)")
        if "server_id" in server:
            if not isinstance(server_id, str):
                problems.append(f"{place}: server_id must be a string, got "
                                f"{_describe(server_id)}")
            elif not server_id.strip():
                problems.append(f"{place}: server_id is empty")
            elif server_id in server_ids:
                problems.append(f"{place}: duplicate server_id {server_id!r} "
                                f"(also {server_ids[server_id]})")
            else:
                server_ids[server_id] = f"server_list[{index}]"
        if "host_nic_ip" in server and not isinstance(server["host_nic_ip"], str):
            problems.append(f"{place}: host_nic_ip must be a string, got "
                            f"{_describe(server['host_nic_ip'])}")

        devices = server.get("device")
        if "device" not in server:
            continue
        if not isinstance(devices, list):
            problems.append(f"{place}: device must be a list, got {_json_type(devices)}")
            continue
        if not devices:
            problems.append(f"{place}: device list is empty")
            continue
        total_devices += len(devices)
        device_ids = {}
        for position, device in enumerate(devices):
            problems.extend(_check_device(place, position, device, device_ids, device_ips,
                                          rank_ids))

        count = len(devices)
        if count not in ALLOWED_DEVICES_PER_SERVER:
            problems.append(f"{place}: {count} devices; HCCL runs 1, 2, 4 or 8 devices "
                            f"on a server")
        elif count in (2, 4) and len(device_ids) == count:
            groups = {device_id // GROUP_SIZE for device_id in device_ids}
            if len(groups) > 1:
                problems.append(f"{place}: devices {_join_ints(sorted(device_ids))} span both "
                                f"groups; a {count}-device server must use devices from "
                                f"one group (0-3 or 4-7)")
        counts.append((place, count))

    if len({count for _, count in counts}) > 1:
        by_count = {}
        for place, count in counts:
            by_count.setdefault(count, []).append(place)
        listing = "; ".join(f"{count} on {_abbreviate(places)}"
                            for count, places in by_count.items())
        problems.append(f"servers have different device counts ({listing}); HCCL needs the "
                        f"same number of devices on every server")

    if rank_ids and total_devices:
        expected = set(range(total_devices))
        missing = sorted(expected - set(rank_ids))
        beyond = sorted(set(rank_ids) - expected)
        if missing or beyond:
            detail = []
            if missing:
                detail.append(f"missing {_join_ints(missing)}")
            if beyond:
                detail.append(f"out of range {_join_ints(beyond)}")
            problems.append(f"rank_id values are not contiguous from 0: {total_devices} "
                            f"devices need ranks 0-{total_devices - 1}; "
                            + ", ".join(detail))
    if device_num is not None and total_devices != int(device_num):
        problems.append(f"the table lists {total_devices} device"
                        f"{'s' if total_devices != 1 else ''} but {int(device_num)} "
                        f"are expected (device_num)")
    return problems


def _check_device(server_place, position, device, device_ids, device_ips, rank_ids):
    problems = []
    if not isinstance(device, dict):
        return [f"{server_place}: device[{position}] must be an object, "
                f"got {_json_type(device)}"]
    device_id = device.get("device_id")
    place = f"{server_place}: device[{position}]" + (
        f" (device_id {device_id})" if isinstance(device_id, str) else "")
    missing = [field for field in DEVICE_FIELDS if field not in device]
    if missing:
        problems.append(f"{place}: missing field{_plural(missing)} {', '.join(missing)}")
    extra = [field for field in device if field not in DEVICE_FIELDS]
    if extra:
        problems.append(f"{place}: unexpected field{_plural(extra)} "
                        f"{', '.join(map(str, extra))} (not part of v1.0)")
    for field in DEVICE_FIELDS:
        if field in device and not isinstance(device[field], str):
            problems.append(f"{place}: {field} must be a string, got {_describe(device[field])}")

    if isinstance(device_id, str):
        if device_id not in {str(number) for number in range(DEVICES_PER_SERVER)}:
            problems.append(f"{place}: device_id {device_id!r} is not a device number 0-7")
        elif int(device_id) in device_ids:
            problems.append(f"{place}: device_id {device_id} appears twice on this server "
                            f"(also device[{device_ids[int(device_id)]}])")
        else:
            device_ids[int(device_id)] = position

    device_ip = device.get("device_ip")
    if isinstance(device_ip, str):
        if not _is_ipv4(device_ip):
            problems.append(f"{place}: device_ip {device_ip!r} is not a valid IPv4 address")
        elif device_ip in device_ips:
            problems.append(f"{place}: device_ip {device_ip} is used twice "
                            f"(also {device_ips[device_ip]})")
        else:
            device_ips[device_ip] = place

    rank_id = device.get("rank_id")
    if isinstance(rank_id, str):
        if not _DIGITS.fullmatch(rank_id):
            problems.append(f"{place}: rank_id {rank_id!r} is not a non-negative integer")
        elif int(rank_id) in rank_ids:
            problems.append(f"{place}: rank_id {rank_id} is used twice "
                            f"(also {rank_ids[int(rank_id)]})")
        else:
            rank_ids[int(rank_id)] = place
    return problems


# --------------------------------------------------------------------------- generating


def parse_device_range(device_range: str) -> list:
    """Devices of a half-open range "[first,last)", e.g. "[0,8)" -> [0, ..., 7].

    Raises:
        RankTableError: not of that form, outside 0-8, not 1, 2, 4 or 8 devices, or a 2- or
            4-device range crossing the groups 0-3 and 4-7.
    """
    match = _RANGE.fullmatch(str(device_range))
    source = f"device range {device_range!r}"
    if not match:
        raise RankTableError(source, 'expected a half-open range such as "[0,8)", "[0,4)" '
                                     'or "[4,8)"')
    first, last = int(match.group(1)), int(match.group(2))
    if last > DEVICES_PER_SERVER or first >= last:
        raise RankTableError(source, f"must satisfy 0 <= first < last <= {DEVICES_PER_SERVER}")
    devices = list(range(first, last))
    if len(devices) not in ALLOWED_DEVICES_PER_SERVER:
        raise RankTableError(source, f"{len(devices)} devices; HCCL runs 1, 2, 4 or 8 devices "
                                     f"on a server")
    if len(devices) in (2, 4) and first // GROUP_SIZE != (last - 1) // GROUP_SIZE:
        raise RankTableError(source, "crosses the device groups 0-3 and 4-7; a 2- or "
                                     "4-device range must stay inside one group")
    return devices


def read_hccn_conf(path=DEFAULT_HCCN_CONF) -> dict:
    """Device addresses from an hccn.conf: {device_id: ip} from its `address_N=IP` lines.

    Raises:
        RankTableError: the file is missing or unreadable, or an address line is malformed.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise RankTableError(path, "hccn.conf not found (it holds the device addresses as "
                                   "address_N=IP lines; pass --hccn-conf PATH)")
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise RankTableError(path, f"cannot read hccn.conf: {err}") from None
    addresses = {}
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line.startswith("address_"):
            continue
        match = _ADDRESS_LINE.fullmatch(line)
        if not match or not _is_ipv4(match.group(2)):
            raise RankTableError(path, f"line {number}: expected address_N=IPv4, got {line!r}")
        addresses[int(match.group(1))] = match.group(2)
    return addresses


def generate_rank_table(device_range: str, hccn_conf: str = DEFAULT_HCCN_CONF,
                        server_ip: str = None) -> dict:
    """A one-server rank table for the devices in `device_range`, as MindSpore's hccl_tools.

    Args:
        device_range: half-open device range, e.g. "[0,8)", "[0,4)", "[4,8)".
        hccn_conf: the file holding each device's address (`address_N=IP`).
        server_ip: this server's address; detected (first non-loopback IPv4) when omitted.

    Returns:
        A valid v1.0 rank table; rank ids run from 0 in device order.

    Raises:
        RankTableError: bad range, missing hccn.conf or device address, bad or undetectable
            server address.
    """
    devices = parse_device_range(device_range)
    addresses = read_hccn_conf(hccn_conf)
    missing = [device for device in devices if device not in addresses]
    if missing:
        raise RankTableError(os.fspath(hccn_conf),
                             f"no address_N line for device{'s' if len(missing) > 1 else ''} "
                             f"{_join_ints(missing)} (range {device_range})")
    if server_ip is None:
        server_ip = host_ipv4()
    elif not _is_ipv4(server_ip):
        raise RankTableError("server ip", f"{server_ip!r} is not a valid IPv4 address")
    table = {
        "version": SUPPORTED_VERSION,
        "server_count": "1",
        "server_list": [{
            "server_id": server_ip,
            "device": [{"device_id": str(device), "device_ip": addresses[device],
                        "rank_id": str(rank)} for rank, device in enumerate(devices)],
            "host_nic_ip": "reserve",
        }],
        "status": "completed",
    }
    validate_rank_table(table, source="generated rank table")
    return table


def default_generate_name(table) -> str:
    """hccl_tools' file name: `hccl_<n>p_<device ids>_<server ip>.json`."""
    server = table["server_list"][0]
    device_ids = [device["device_id"] for device in server["device"]]
    return f"hccl_{len(device_ids)}p_{''.join(device_ids)}_{server['server_id']}.json"


def default_merge_name(table) -> str:
    """merge_hccl's file name: `hccl_<servers>s_<ranks>p.json`."""
    ranks = sum(len(server["device"]) for server in table["server_list"])
    return f"hccl_{table['server_count']}s_{ranks}p.json"


# --------------------------------------------------------------------------- merging


def merge_rank_tables(tables, sources=None) -> dict:
    """Join single- or multi-server tables into one cluster table.

    Servers keep the given order; ranks are renumbered contiguously across servers in that
    order (within a server, devices keep their rank order).

    Raises:
        RankTableError: an input is invalid, no tables are given, a server_id appears in
            two inputs, or the merged table is invalid (e.g. a device_ip used twice, or
            servers with different device counts).
    """
    tables = list(tables)
    sources = list(sources) if sources else [f"table {i + 1}" for i in range(len(tables))]
    if not tables:
        raise RankTableError("merge", "no rank tables to merge")
    if len(sources) != len(tables):
        raise ValueError(f"{len(tables)} tables but {len(sources)} sources")
    servers, seen = [], {}
    for table, source in zip(tables, sources):
        validate_rank_table(table, source=source)
        for server in table["server_list"]:
            if server["server_id"] in seen:
                raise RankTableError("merge", f"server_id {server['server_id']} appears in "
                                              f"{seen[server['server_id']]} and in {source}")
            seen[server["server_id"]] = source
            servers.append(server)
    merged_servers, rank = [], 0
    for server in servers:
        devices = []
        for device in sorted(server["device"], key=lambda d: int(d["rank_id"])):
            devices.append({"device_id": device["device_id"], "device_ip": device["device_ip"],
                            "rank_id": str(rank)})
            rank += 1
        merged_servers.append({"server_id": server["server_id"], "device": devices,
                               "host_nic_ip": server.get("host_nic_ip", "reserve")})
    merged = {"version": SUPPORTED_VERSION, "server_count": str(len(merged_servers)),
              "server_list": merged_servers, "status": "completed"}
    validate_rank_table(merged, source="merged rank table")
    return merged


# --------------------------------------------------------------------------- launching


def local_devices(table, server_ip=None, rank_start=None, source="<table>") -> list:
    """This server's devices as [(device_id, rank_id), ...] ints, in rank order.

    The server is the first of: the one whose smallest rank_id is `rank_start`; the one
    whose server_id or host_nic_ip is `server_ip`; the only server of a one-server table;
    the one whose server_id or host_nic_ip is an IPv4 address of this machine.

    Raises:
        RankTableError: the table is invalid, or no (or more than one) server matches.
    """
    validate_rank_table(table, source=source)
    servers = table["server_list"]
    if rank_start is not None:
        starts = {min(int(d["rank_id"]) for d in server["device"]): server for server in servers}
        if int(rank_start) not in starts:
            listing = ", ".join(f"{server['server_id']} starts at {start}"
                                for start, server in starts.items())
            raise RankTableError(source, f"no server's ranks start at {rank_start} ({listing})")
        chosen = starts[int(rank_start)]
    elif server_ip is not None:
        chosen = _server_by_address(table, {server_ip}, source, f"server ip {server_ip}")
    elif len(servers) == 1:
        chosen = servers[0]
    else:
        addresses = local_ipv4_addresses()
        chosen = _server_by_address(
            table, addresses, source,
            "this machine's addresses (" + (", ".join(sorted(addresses)) or "none found") + ")")
    return sorted(((int(d["device_id"]), int(d["rank_id"])) for d in chosen["device"]),
                  key=lambda pair: pair[1])


def _server_by_address(table, addresses, source, what):
    matches = [server for server in table["server_list"]
               if server["server_id"] in addresses or server.get("host_nic_ip") in addresses]
    server_ids = ", ".join(server["server_id"] for server in table["server_list"])
    if not matches:
        raise RankTableError(source, f"no server matches {what}; the table's servers are "
                                     f"{server_ids} (pass --server-ip or --rank-start)")
    if len(matches) > 1:
        raise RankTableError(source, f"several servers match {what}: "
                                     + ", ".join(server["server_id"] for server in matches)
                                     + " (pass --server-ip or --rank-start)")
    return matches[0]


def host_ipv4() -> str:
    """This machine's first non-loopback IPv4 address, found without sending anything.

    Raises:
        RankTableError: none found (then pass the address explicitly).
    """
    for address in _candidate_host_addresses():
        if _is_ipv4(address) and not ipaddress.IPv4Address(address).is_loopback:
            return address
    raise RankTableError("server ip", "could not find this machine's IPv4 address; "
                                      "pass it with --server-ip")


def _candidate_host_addresses():
    try:
        # connect() on a UDP socket only picks the outgoing interface: no packet is sent.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("10.254.254.254", 1))
            yield probe.getsockname()[0]
    except OSError:
        pass
    try:
        yield socket.gethostbyname(socket.gethostname())
    except OSError:
        pass


def local_ipv4_addresses() -> set:
    """Non-loopback IPv4 addresses of this machine (`ip -o -4 addr`, then the host name)."""
    addresses = set()
    ip_command = shutil.which("ip")
    if ip_command:
        try:
            output = subprocess.run([ip_command, "-o", "-4", "addr"], capture_output=True,
                                    text=True, timeout=5, check=False).stdout
            addresses.update(_INET.findall(output))
        except (OSError, subprocess.SubprocessError):
            pass
    addresses.update(_candidate_host_addresses())
    return {address for address in addresses
            if _is_ipv4(address) and not ipaddress.IPv4Address(address).is_loopback}


# --------------------------------------------------------------------------- writing


def write_rank_table(table, path):
    """Write `table` as JSON (indent 4) atomically: a temporary file, then a rename."""
    write_json_atomically(path, table, indent=4)


# --------------------------------------------------------------------------- command line


def add_rank_table_arguments(parser):
    """The `model-zoo rank-table {generate,validate,merge,devices}` subcommands."""
    actions = parser.add_subparsers(dest="rank_table_command", required=True, metavar="ACTION")

    generate = actions.add_parser(
        "generate", help="write this server's rank table from hccn.conf (like hccl_tools)")
    generate.add_argument("--device-num", default="[0,8)", metavar="RANGE",
                          help='half-open device range: "[0,8)", "[0,4)", "[4,8)", "[0,1)" '
                               '... (default: "[0,8)")')
    generate.add_argument("--hccn-conf", default=DEFAULT_HCCN_CONF, metavar="PATH",
                          help=f"device addresses as address_N=IP lines "
                               f"(default: {DEFAULT_HCCN_CONF})")
    generate.add_argument("--server-ip", metavar="IP",
                          help="this server's IPv4 address (default: detected)")
    generate.add_argument("-o", "--output", metavar="OUT", help="output file (default: "
                                                 "hccl_<n>p_<devices>_<ip>.json here)")
    generate.add_argument("--force", action="store_true", help="overwrite an existing output")

    validate = actions.add_parser("validate", help="check a rank table (v1.0, Ascend 910 rules)")
    validate.add_argument("file", help="rank table JSON")
    validate.add_argument("--device-num", type=int, metavar="N",
                          help="the total number of devices the job expects")

    merge = actions.add_parser("merge", help="join per-server rank tables into one "
                                             "(ranks renumbered in the given order)")
    merge.add_argument("files", nargs="+", metavar="FILE", help="rank tables, in server order")
    merge.add_argument("-o", "--output", metavar="OUT", help="output file (default: "
                                              "hccl_<servers>s_<ranks>p.json here)")
    merge.add_argument("--force", action="store_true", help="overwrite an existing output")

    devices = actions.add_parser("devices", help="print 'DEVICE_ID RANK_ID' for each device "
                                                 "of this server (for launch scripts)")
    devices.add_argument("file", help="rank table JSON")
    devices.add_argument("--server-ip", metavar="IP",
                         help="pick the server by server_id / host_nic_ip")
    devices.add_argument("--rank-start", type=int, metavar="N",
                         help="pick the server whose first rank is N")


def run_rank_table_command(args) -> int:
    """Run a `model-zoo rank-table` action; errors are RankTableError (exit status 2)."""
    action = args.rank_table_command
    if action == "generate":
        table = generate_rank_table(args.device_num, args.hccn_conf, args.server_ip)
        _write_output(table, args.output or default_generate_name(table), args.force)
    elif action == "validate":
        table = load_rank_table(args.file)
        validate_rank_table(table, device_num=args.device_num, source=args.file)
        total = sum(len(server["device"]) for server in table["server_list"])
        servers = len(table["server_list"])
        print(f"{args.file}: valid, {servers} server{'s' if servers != 1 else ''}, "
              f"{total} device{'s' if total != 1 else ''}")
    elif action == "merge":
        tables = [load_rank_table(path) for path in args.files]
        table = merge_rank_tables(tables, sources=args.files)
        _write_output(table, args.output or default_merge_name(table), args.force)
    elif action == "devices":
        table = load_rank_table(args.file)
        for device_id, rank_id in local_devices(table, server_ip=args.server_ip,
                                                rank_start=args.rank_start, source=args.file):
            print(device_id, rank_id)
    return 0


def _write_output(table, path, force):
    if os.path.exists(path) and not force:
        raise RankTableError(path, "already exists; pass --force to overwrite it")
    write_rank_table(table, path)
    print(path)


# --------------------------------------------------------------------------- helpers


def _is_ipv4(text) -> bool:
    try:
        ipaddress.IPv4Address(text)
    except (ipaddress.AddressValueError, ValueError, TypeError):
        return False
    return True


def _json_type(value) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if value is None:
        return "null"
    names = {dict: "an object", list: "a list", str: "a string"}
    return names.get(type(value), type(value).__name__)


def _describe(value) -> str:
    return f"{json.dumps(value)} ({_json_type(value)})"


def _plural(items) -> str:
    return "s" if len(items) > 1 else ""


def _join_ints(numbers) -> str:
    return _abbreviate([str(number) for number in numbers])


def _abbreviate(items, limit=8) -> str:
    items = list(items)
    if len(items) <= limit:
        return ", ".join(items)
    return ", ".join(items[:limit]) + f", ... ({len(items)} in all)"

"""HCCL rank tables: the examples, validation errors, generate/merge round trips, the launcher
lookup and the `model-zoo rank-table` command (in process, no MindSpore needed)."""

import copy
import os
from pathlib import Path

import pytest

from model_zoo.cli import main
from model_zoo.launch import rank_table as rt
from model_zoo.launch.rank_table import (RankTableError, generate_rank_table, load_rank_table,
                                         local_devices, merge_rank_tables, validate_rank_table,
                                         write_rank_table)

EXAMPLES = Path(__file__).resolve().parent.parent / "rank_tables"
EXAMPLE_SIZES = {"rank_table_1p.json": (1, 1), "rank_table_2p.json": (1, 2),
                 "rank_table_4p.json": (1, 4), "rank_table_8p.json": (1, 8),
                 "rank_table_2x8p.json": (2, 16)}


def example(name):
    return load_rank_table(EXAMPLES / name)


def write_hccn_conf(path, first_octet=100, devices=range(8)):
    lines = ["# device addresses, as hccn_tool writes them", ""]
    for device in devices:
        lines += [f"address_{device}=192.168.{first_octet + device % 4}.{101 + device // 4}",
                  f"netmask_{device}=255.255.255.0", f"netdetect_{device}=192.168.100.1"]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


# --------------------------------------------------------------------------- examples


@pytest.mark.parametrize("name", sorted(EXAMPLE_SIZES))
def test_every_example_validates(name):
    servers, devices = EXAMPLE_SIZES[name]
    table = example(name)
    assert validate_rank_table(table, source=name) == []
    assert validate_rank_table(table, device_num=devices, source=name) == []
    assert len(table["server_list"]) == servers
    with pytest.raises(RankTableError, match=rf"lists {devices} devices? but {devices * 2} "):
        validate_rank_table(table, device_num=devices * 2, source=name)


def test_examples_match_the_readme():
    assert sorted(p.name for p in EXAMPLES.glob("*.json")) == sorted(EXAMPLE_SIZES)
    for name in ("rank_table_1p.json", "rank_table_2p.json", "rank_table_4p.json",
                 "rank_table_8p.json"):
        assert example(name)["server_list"][0]["server_id"] == "127.0.0.1"
    ranks = [device["rank_id"] for server in example("rank_table_2x8p.json")["server_list"]
             for device in server["device"]]
    assert ranks == [str(rank) for rank in range(16)]


# --------------------------------------------------------------------------- bad tables


def _server(table, index=1):
    return table["server_list"][index]


def _device(table, server=1, device=2):
    return table["server_list"][server]["device"][device]


BAD_TABLES = {
    "missing field": (lambda t: t.pop("status"), "missing top-level field: status"),
    "extra field": (lambda t: t.update(para="x"), "unexpected top-level field: para"),
    "version 1.2": (lambda t: t.update(version="1.2"),
                    "unsupported version '1.2': this validates rank table version \"1.0\""),
    "number value": (lambda t: _device(t).update(rank_id=10),
                     "device[2] (device_id 2): rank_id must be a string, got 10"),
    "status": (lambda t: t.update(status="pending"), "status is 'pending', must be \"completed\""),
    "server_count": (lambda t: t.update(server_count="3"),
                     "server_count is '3' but server_list has 2 servers"),
    "no servers": (lambda t: t.update(server_list=[], server_count="0"), "server_list is empty"),
    "duplicate server": (lambda t: _server(t).update(server_id="10.155.111.140"),
                         "server_list[1] (server_id 10.155.111.140): duplicate server_id"),
    "empty devices": (lambda t: _server(t).update(device=[]),
                      "server_list[1] (server_id 10.155.111.141): device list is empty"),
    "device_id 8": (lambda t: _device(t).update(device_id="8"),
                    "device[2] (device_id 8): device_id '8' is not a device number 0-7"),
    "duplicate device_id": (lambda t: _device(t).update(device_id="3"),
                            "device_id 3 appears twice on this server"),
    "bad device_ip": (lambda t: _device(t).update(device_ip="192.168.101.300"),
                      "device_ip '192.168.101.300' is not a valid IPv4 address"),
    "duplicate device_ip": (lambda t: _device(t).update(device_ip="192.168.100.101"),
                            "device_ip 192.168.100.101 is used twice"),
    "negative rank": (lambda t: _device(t).update(rank_id="-1"),
                      "rank_id '-1' is not a non-negative integer"),
    "duplicate rank": (lambda t: _device(t).update(rank_id="3"), "rank_id 3 is used twice"),
    "rank gap": (lambda t: _device(t, 1, 7).update(rank_id="20"),
                 "not contiguous from 0: 16 devices need ranks 0-15; missing 15, "
                 "out of range 20"),
    "3 devices": (lambda t: [_server(t, 0)["device"].pop() for _ in range(5)],
                  "server_list[0] (server_id 10.155.111.140): 3 devices; HCCL runs 1, 2, 4 or 8"),
    "unequal servers": (lambda t: [_server(t)["device"].pop() for _ in range(4)],
                        "servers have different device counts"),
    "v1.2 device field": (lambda t: _device(t).update(super_device_id="5"),
                          "device[2] (device_id 2): unexpected field super_device_id"),
    "server not an object": (lambda t: t["server_list"].append("10.0.0.3") or
                             t.update(server_count="3"),
                             "server_list[2] must be an object, got a string"),
}


@pytest.mark.parametrize("kind", sorted(BAD_TABLES))
def test_bad_table_is_rejected_with_a_specific_message(kind):
    mutate, expected = BAD_TABLES[kind]
    table = copy.deepcopy(example("rank_table_2x8p.json"))
    mutate(table)
    with pytest.raises(RankTableError) as caught:
        validate_rank_table(table, source="cluster.json")
    message = str(caught.value)
    assert message.startswith("cluster.json: ")
    assert expected in message
    assert "\n" not in message


def test_two_or_four_devices_must_stay_in_one_group():
    table = example("rank_table_4p.json")
    for device, device_id in zip(table["server_list"][0]["device"], ("2", "3", "4", "5")):
        device["device_id"] = device_id
    with pytest.raises(RankTableError, match=r"devices 2, 3, 4, 5 span both groups; a 4-device "
                                             r"server must use devices from one group"):
        validate_rank_table(table)
    for device, device_id in zip(table["server_list"][0]["device"], ("4", "5", "6", "7")):
        device["device_id"] = device_id
    assert validate_rank_table(table) == []


def test_every_problem_is_listed():
    table = example("rank_table_2x8p.json")
    table["status"] = "pending"
    _device(table).update(device_ip="nope")
    _device(table, 0, 0).update(device_id="x")
    with pytest.raises(RankTableError) as caught:
        validate_rank_table(table, source="t.json")
    assert len(caught.value.problems) == 3
    assert str(caught.value).startswith("t.json: 3 problems: ")


def test_load_errors(tmp_path):
    with pytest.raises(RankTableError, match="missing.json: rank table file not found"):
        load_rank_table(tmp_path / "missing.json")
    broken = tmp_path / "broken.json"
    broken.write_text('{\n  "version": "1.0",\n  "status": completed\n}\n')
    with pytest.raises(RankTableError, match=r"broken.json: not valid JSON at line 3 column 13"):
        load_rank_table(broken)
    listed = tmp_path / "list.json"
    listed.write_text("[]")
    with pytest.raises(RankTableError, match="must be a JSON object, got a list"):
        load_rank_table(listed)


# --------------------------------------------------------------------------- generate / merge


def test_generate_validate_round_trip(tmp_path):
    conf = write_hccn_conf(tmp_path / "hccn.conf")
    table = generate_rank_table("[4,8)", conf, server_ip="10.155.111.140")
    assert validate_rank_table(table, device_num=4) == []
    server = table["server_list"][0]
    assert server["server_id"] == "10.155.111.140" and server["host_nic_ip"] == "reserve"
    assert [(d["device_id"], d["rank_id"]) for d in server["device"]] == [
        ("4", "0"), ("5", "1"), ("6", "2"), ("7", "3")]
    assert server["device"][0]["device_ip"] == "192.168.100.102"
    path = tmp_path / "out" / "rt.json"
    write_rank_table(table, path)
    assert load_rank_table(path) == table
    assert path.read_text().startswith('{\n    "version": "1.0"')
    assert os.listdir(path.parent) == ["rt.json"]  # no temporary file left behind


def test_generate_errors(tmp_path):
    conf = write_hccn_conf(tmp_path / "hccn.conf", devices=range(4))
    with pytest.raises(RankTableError, match=r"hccn.conf: no address_N line for devices 4, 5, "
                                             r"6, 7 \(range \[0,8\)\)"):
        generate_rank_table("[0,8)", conf, server_ip="10.0.0.1")
    with pytest.raises(RankTableError, match="crosses the device groups"):
        generate_rank_table("[3,5)", conf, server_ip="10.0.0.1")
    with pytest.raises(RankTableError, match="3 devices; HCCL runs 1, 2, 4 or 8"):
        generate_rank_table("[0,3)", conf, server_ip="10.0.0.1")
    with pytest.raises(RankTableError, match="half-open range"):
        generate_rank_table("0-8", conf, server_ip="10.0.0.1")
    with pytest.raises(RankTableError, match="nowhere.conf: hccn.conf not found"):
        generate_rank_table("[0,1)", str(tmp_path / "nowhere.conf"), server_ip="10.0.0.1")


def test_server_address_detection(tmp_path, monkeypatch):
    conf = write_hccn_conf(tmp_path / "hccn.conf")
    monkeypatch.setattr(rt, "_candidate_host_addresses", lambda: iter(["127.0.1.1", "10.2.3.4"]))
    assert generate_rank_table("[0,1)", conf)["server_list"][0]["server_id"] == "10.2.3.4"
    monkeypatch.setattr(rt, "_candidate_host_addresses", lambda: iter(["127.0.1.1"]))
    with pytest.raises(RankTableError, match="pass it with --server-ip"):
        generate_rank_table("[0,1)", conf)


def test_merge_two_generated_tables(tmp_path):
    first = generate_rank_table("[0,8)", write_hccn_conf(tmp_path / "a.conf", 100),
                                server_ip="10.155.111.140")
    second = generate_rank_table("[0,8)", write_hccn_conf(tmp_path / "b.conf", 110),
                                 server_ip="10.155.111.141")
    merged = merge_rank_tables([first, second])
    assert validate_rank_table(merged, device_num=16) == []
    assert merged["server_count"] == "2"
    assert [s["server_id"] for s in merged["server_list"]] == ["10.155.111.140",
                                                               "10.155.111.141"]
    ranks = [d["rank_id"] for s in merged["server_list"] for d in s["device"]]
    assert ranks == [str(rank) for rank in range(16)]
    assert first["server_list"][0]["device"][0]["rank_id"] == "0"  # inputs untouched
    with pytest.raises(RankTableError, match="server_id 10.155.111.140 appears in a.json and in "
                                             "b.json"):
        merge_rank_tables([first, first], sources=["a.json", "b.json"])


# --------------------------------------------------------------------------- launcher lookup


def test_local_devices():
    cluster = example("rank_table_2x8p.json")
    assert local_devices(cluster, rank_start=8) == [(device, 8 + device) for device in range(8)]
    assert local_devices(cluster, server_ip="10.155.111.140") == [(d, d) for d in range(8)]
    assert local_devices(example("rank_table_4p.json")) == [(0, 0), (1, 1), (2, 2), (3, 3)]
    with pytest.raises(RankTableError, match="no server's ranks start at 4"):
        local_devices(cluster, rank_start=4)
    with pytest.raises(RankTableError, match="the table's servers are 10.155.111.140, "
                                             "10.155.111.141"):
        local_devices(cluster, server_ip="10.9.9.9")


def test_local_devices_from_this_machines_addresses(monkeypatch):
    cluster = example("rank_table_2x8p.json")
    monkeypatch.setattr(rt, "local_ipv4_addresses", lambda: {"172.17.0.2", "10.155.111.141"})
    assert local_devices(cluster)[0] == (0, 8)
    monkeypatch.setattr(rt, "local_ipv4_addresses", lambda: {"172.17.0.2"})
    with pytest.raises(RankTableError, match=r"no server matches this machine's addresses "
                                             r"\(172.17.0.2\)"):
        local_devices(cluster)


def test_this_machines_addresses_exclude_loopback(monkeypatch):
    output = ("1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever\n"
              "4: eth0    inet 10.155.111.140/24 brd 10.155.111.255 scope global eth0\n")
    assert rt._INET.findall(output) == ["127.0.0.1", "10.155.111.140"]
    monkeypatch.setattr(rt, "_candidate_host_addresses", lambda: iter(["127.0.1.1"]))
    assert all(not address.startswith("127.") for address in rt.local_ipv4_addresses())


# --------------------------------------------------------------------------- command line


def test_cli_validate(capsys):
    path = str(EXAMPLES / "rank_table_2x8p.json")
    assert main(["rank-table", "validate", path, "--device-num", "16"]) == 0
    assert capsys.readouterr().out == f"{path}: valid, 2 servers, 16 devices\n"
    assert main(["rank-table", "validate", path, "--device-num", "8"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}: ")
    assert "16 devices but 8 are expected" in lines[0]


def test_cli_validate_bad_file(tmp_path, capsys):
    table = example("rank_table_8p.json")
    table["server_list"][0]["device"][5]["device_ip"] = "192.168.100.999"
    table["server_count"] = 1
    path = tmp_path / "bad.json"
    write_rank_table(table, path)
    assert main(["rank-table", "validate", str(path)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "2 problems" in lines[0]
    assert "server_count must be a string" in lines[0]
    assert "device[5] (device_id 5): device_ip '192.168.100.999'" in lines[0]


def test_cli_generate_merge_and_devices(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    conf_a = write_hccn_conf(tmp_path / "a.conf", 100)
    conf_b = write_hccn_conf(tmp_path / "b.conf", 110)
    assert main(["rank-table", "generate", "--device-num", "[0,8)", "--hccn-conf", conf_a,
                 "--server-ip", "10.155.111.140"]) == 0
    first = "hccl_8p_01234567_10.155.111.140.json"
    assert capsys.readouterr().out == first + "\n"
    assert validate_rank_table(load_rank_table(tmp_path / first), device_num=8) == []
    assert main(["rank-table", "generate", "--hccn-conf", conf_b,
                 "--server-ip", "10.155.111.141", "-o", "b.json"]) == 0
    capsys.readouterr()

    # an existing output is kept unless --force
    before = (tmp_path / "b.json").read_text()
    assert main(["rank-table", "generate", "--device-num", "[0,4)", "--hccn-conf", conf_b,
                 "--server-ip", "10.155.111.141", "-o", "b.json"]) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert (tmp_path / "b.json").read_text() == before

    assert main(["rank-table", "merge", first, "b.json", "-o", "cluster.json"]) == 0
    assert capsys.readouterr().out == "cluster.json\n"
    merged = load_rank_table(tmp_path / "cluster.json")
    assert validate_rank_table(merged, device_num=16) == []
    assert merged["server_list"][1]["device"][0]["rank_id"] == "8"
    assert main(["rank-table", "merge", first, first, "-o", "twice.json"]) == 2
    assert "appears in" in capsys.readouterr().err
    assert not (tmp_path / "twice.json").exists()

    assert main(["rank-table", "devices", "cluster.json", "--rank-start", "8"]) == 0
    assert capsys.readouterr().out.splitlines() == [f"{d} {8 + d}" for d in range(8)]
    assert main(["rank-table", "devices", "cluster.json", "--server-ip", "10.155.111.140"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "7 7"

    assert main(["rank-table", "generate", "--device-num", "[0,4)", "--hccn-conf", conf_b,
                 "--server-ip", "10.155.111.141", "-o", "b.json", "--force"]) == 0
    assert len(load_rank_table(tmp_path / "b.json")["server_list"][0]["device"]) == 4


def test_cores_are_split_evenly_in_device_order_or_not_at_all():
    from model_zoo.launch.local import core_ranges, cpu_list
    assert core_ranges(8, range(192)) == [f"{24 * i}-{24 * i + 23}" for i in range(8)]
    assert core_ranges(2, [0, 1, 2, 3, 8, 9, 10]) == ["0-2", "3,8-9"]
    assert core_ranges(8, range(2)) is None
    assert cpu_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


def test_the_launcher_dry_run_prints_each_rank_as_a_shell_command(tmp_path):
    """`--dry-run` with `--devices`: one line a rank with the variables the launch adds (the
    job's --env, DEVICE_ID, RANK_ID, the rank's own CANN folder) and the bound command, each
    word quoted for a shell; nothing is written."""
    import shlex
    import subprocess
    import sys
    result = subprocess.run(
        [sys.executable, "-m", "model_zoo.launch", "--devices", "4:8,5:9", "--output-dir",
         str(tmp_path / "out"), "--env", "RANK_SIZE=16", "--env", "NOTE=a b", "--rank-workdirs",
         "--dry-run", "--", "python3", "-m", "model_zoo", "train", "my config.yaml"],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["rank 8 device 4", "rank 9 device 5"]
    words = shlex.split(lines[1].split(": ", 1)[1])
    assert words[:4] == ["RANK_SIZE=16", "NOTE=a b", "DEVICE_ID=5", "RANK_ID=9"]
    assert words[4] == f"ASCEND_WORK_PATH={tmp_path}/out/rank_9/ascend_work"
    assert words[-5:] == ["python3", "-m", "model_zoo", "train", "my config.yaml"]
    assert not (tmp_path / "out").exists()


def test_the_resume_command_is_the_start_command_with_resume_once():
    from model_zoo.launch.local import resume_command
    start = "cd /srv/zoo && SERVER_IP=10.0.0.2 bash scripts/run_distribute_train.sh 16 t.json"
    assert resume_command(start) == start + " --resume"
    assert resume_command(start + " --resume") == start + " --resume"

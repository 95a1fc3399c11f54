//! Black-box checks of `spillway serve` and `spillway fetch` over 127.0.0.1.

#[test]
fn cli_serve_and_fetch() {
    let exe = env!("CARGO_BIN_EXE_spillway");
    let src = tempfile::tempdir().unwrap();
    let dst = tempfile::tempdir().unwrap();
    let value: Vec<u8> = (0..3u32 << 20).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
    let vfile = src.path().join("value");
    std::fs::write(&vfile, &value).unwrap();
    let store = src.path().join("store");
    let st = std::process::Command::new(exe).arg("put").arg(&store).arg("big").arg(&vfile).status().unwrap();
    assert!(st.success());
    let mut server = std::process::Command::new(exe)
        .arg("serve")
        .arg(&store)
        .args(["--listen", "127.0.0.1:0"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(server.stdout.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut lines, &mut line).unwrap();
    let addr = line.trim().strip_prefix("listening on ").expect("the server prints its address").to_string();
    line.clear();
    std::io::BufRead::read_line(&mut lines, &mut line).unwrap();
    let token = line.trim().strip_prefix("token ").expect("the server prints its fresh token").to_string();
    let fetch = |args: &[&str]| {
        let mut c = std::process::Command::new(exe);
        c.arg("fetch").arg(&addr).args(args).env("SPILLWAY_TOKEN", &token);
        c
    };
    let out = fetch(&["big"]).output().unwrap();
    assert!(out.status.success());
    assert!(out.stdout == value);
    // Another token (on the command line, which wins over the environment): refused, nothing out.
    let wrong = format!("{}{}", &token[..47], if token.ends_with('0') { '1' } else { '0' });
    let out = fetch(&["big", "--token", &wrong]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(out.stdout.is_empty());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("not authorized"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let into = dst.path().join("store2");
    let st = fetch(&["big", "--into"]).arg(&into).status().unwrap();
    assert!(st.success());
    let out = std::process::Command::new(exe).arg("get").arg(&into).arg("big").output().unwrap();
    assert!(out.stdout == value);
    let out = fetch(&["missing"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not found"));
    server.kill().unwrap();
    server.wait().unwrap();
    let out = fetch(&["big", "--timeout", "2"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("refused"), "{}", String::from_utf8_lossy(&out.stderr));
    let out =
        std::process::Command::new(exe).arg("serve").arg(&store).args(["--listen", "0.0.0.0:0"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--allow-remote"));
}

<?php
// boinc-dl admin page: Redis access, data loading and HTML/SVG rendering.
// Included by boincdl.php; requesting this file directly outputs nothing.
//
// Written for PHP 7.0 (the boinc-server-docker images run PHP 7.0 on Debian
// stretch) up to PHP 8.x. Redis is reached through the small RESP client below,
// over TCP or a Unix socket, so the page needs no PHP extension: the stock BOINC
// server images do not ship phpredis, and their Debian release is archived.

/** Error raised for any Redis connection or protocol problem. */
class BdlRedisError extends Exception {}

/**
 * A minimal Redis client speaking RESP2: enough for AUTH, SELECT and the read
 * commands of the admin page. Bulk strings come back as PHP strings, arrays as
 * PHP arrays, nil as null; an error reply raises BdlRedisError.
 */
class BdlRedis {
    private $sock;

    /**
     * @param string $url  redis://[user:password@]host[:port][/db] or
     *                     unix:///path/to/socket[?db=N][&password=...]
     * @param string|null $password  used when the URL carries none
     * @param float $timeout  connect and read timeout, seconds
     */
    public function __construct($url, $password = null, $timeout = 5.0) {
        $p = self::parse_url($url);
        if ($p['password'] === null) {
            $p['password'] = $password;
        }
        $errno = 0;
        $errstr = '';
        $target = $p['unix'] !== null ? 'unix://' . $p['unix'] : 'tcp://' . $p['host'] . ':' . $p['port'];
        $sock = @stream_socket_client($target, $errno, $errstr, $timeout);
        if (!$sock) {
            throw new BdlRedisError("cannot connect to Redis at $target: $errstr ($errno)");
        }
        stream_set_timeout($sock, (int)$timeout, (int)(($timeout - floor($timeout)) * 1e6));
        $this->sock = $sock;
        if ($p['password'] !== null && $p['password'] !== '') {
            if ($p['user'] !== null && $p['user'] !== '') {
                $this->cmd('AUTH', $p['user'], $p['password']);
            } else {
                $this->cmd('AUTH', $p['password']);
            }
        }
        if ($p['db'] !== 0) {
            $this->cmd('SELECT', (string)$p['db']);
        }
    }

    /** Split a Redis URL into unix/host/port/user/password/db. */
    public static function parse_url($url) {
        $out = array('unix' => null, 'host' => '127.0.0.1', 'port' => 6379, 'user' => null,
                     'password' => null, 'db' => 0);
        if (strpos($url, 'unix://') === 0) {
            $rest = substr($url, 7);
            $q = '';
            $qpos = strpos($rest, '?');
            if ($qpos !== false) {
                $q = substr($rest, $qpos + 1);
                $rest = substr($rest, 0, $qpos);
            }
            $at = strrpos($rest, '@');
            if ($at !== false) {
                $cred = substr($rest, 0, $at);
                $rest = substr($rest, $at + 1);
                $colon = strpos($cred, ':');
                if ($colon !== false) {
                    $out['user'] = rawurldecode(substr($cred, 0, $colon));
                    $out['password'] = rawurldecode(substr($cred, $colon + 1));
                } else {
                    $out['password'] = rawurldecode($cred);
                }
            }
            $out['unix'] = $rest;
            $args = array();
            parse_str($q, $args);
            if (isset($args['db'])) $out['db'] = (int)$args['db'];
            if (isset($args['password'])) $out['password'] = (string)$args['password'];
            return $out;
        }
        $u = parse_url($url);
        if ($u === false || !isset($u['scheme']) || $u['scheme'] !== 'redis') {
            throw new BdlRedisError('unsupported Redis URL (use redis://host:port/db or unix:///path)');
        }
        if (isset($u['host'])) $out['host'] = $u['host'];
        if (isset($u['port'])) $out['port'] = (int)$u['port'];
        if (isset($u['user']) && $u['user'] !== '') $out['user'] = rawurldecode($u['user']);
        if (isset($u['pass'])) $out['password'] = rawurldecode($u['pass']);
        if (isset($u['path']) && trim($u['path'], '/') !== '') $out['db'] = (int)trim($u['path'], '/');
        return $out;
    }

    /** Send one command (arguments as strings), return its reply. */
    public function cmd() {
        $args = func_get_args();
        $buf = '*' . count($args) . "\r\n";
        foreach ($args as $a) {
            $a = (string)$a;
            $buf .= '$' . strlen($a) . "\r\n" . $a . "\r\n";
        }
        for ($off = 0; $off < strlen($buf); $off += $n) {
            $n = @fwrite($this->sock, substr($buf, $off));
            if ($n === false || $n === 0) {
                throw new BdlRedisError('lost the connection to Redis while writing');
            }
        }
        return $this->read_reply();
    }

    private function read_line() {
        $line = fgets($this->sock);
        if ($line === false) {
            $meta = stream_get_meta_data($this->sock);
            throw new BdlRedisError($meta['timed_out'] ? 'Redis did not answer in time' : 'lost the connection to Redis');
        }
        return substr($line, 0, -2);
    }

    private function read_exact($n) {
        $data = '';
        while (strlen($data) < $n) {
            $chunk = fread($this->sock, min(65536, $n - strlen($data)));
            if ($chunk === false || $chunk === '') {
                throw new BdlRedisError('lost the connection to Redis while reading');
            }
            $data .= $chunk;
        }
        return $data;
    }

    private function read_reply() {
        $line = $this->read_line();
        $type = substr($line, 0, 1);
        $rest = substr($line, 1);
        switch ($type) {
        case '+':
            return $rest;
        case '-':
            throw new BdlRedisError('Redis: ' . $rest);
        case ':':
            return (int)$rest;
        case '$':
            $len = (int)$rest;
            if ($len < 0) return null;
            $data = $this->read_exact($len + 2);
            return substr($data, 0, $len);
        case '*':
            $count = (int)$rest;
            if ($count < 0) return null;
            $items = array();
            for ($i = 0; $i < $count; $i++) {
                $items[] = $this->read_reply();
            }
            return $items;
        }
        throw new BdlRedisError('unexpected reply from Redis: ' . substr($line, 0, 40));
    }

    /** HGETALL as an associative array. */
    public function hgetall($key) {
        $flat = $this->cmd('HGETALL', $key);
        $out = array();
        for ($i = 0; $i + 1 < count($flat); $i += 2) {
            $out[$flat[$i]] = $flat[$i + 1];
        }
        return $out;
    }

    /** All keys matching a glob pattern (SCAN, never KEYS). */
    public function scan_keys($pattern) {
        $cursor = '0';
        $keys = array();
        do {
            $r = $this->cmd('SCAN', $cursor, 'MATCH', $pattern, 'COUNT', '1000');
            $cursor = $r[0];
            foreach ($r[1] as $k) $keys[$k] = true;
        } while ($cursor !== '0');
        return array_keys($keys);
    }

    public function close() {
        if ($this->sock) {
            fclose($this->sock);
            $this->sock = null;
        }
    }
}

// ---- configuration ---------------------------------------------------------------------

/**
 * Where Redis is, read like the daemons read it: BDL_REDIS_URL in the environment
 * (with BDL_REDIS_PASSWORD or BDL_REDIS_PASSWORD_FILE), else `redis_url` in the
 * project's boinc-dl.yaml (written by `boinc-dl boinc install`, two levels above
 * html/ops; BDL_SETTINGS names another file), else an ini file (BDL_ADMIN_CONFIG, or
 * boincdl.ini in the project directory: the docker stack) with keys redis_url,
 * redis_password, redis_password_file. No guess: without a URL the page says why.
 */
function bdl_redis_config() {
    $project = dirname(dirname(__DIR__));
    $ini = array();
    $sources = array();
    $path = getenv('BDL_ADMIN_CONFIG');
    if ($path === false || $path === '') {
        $path = $project . '/boincdl.ini';
    }
    if (is_readable($path)) {
        $parsed = parse_ini_file($path, false, INI_SCANNER_RAW);
        if (is_array($parsed)) $ini = $parsed;
    }
    $yaml_path = getenv('BDL_SETTINGS');
    if ($yaml_path === false || $yaml_path === '') {
        $yaml_path = $project . '/boinc-dl.yaml';
    }
    $yaml_url = null;
    if (file_exists($yaml_path)) {
        if (!is_readable($yaml_path)) {
            throw new BdlRedisError("$yaml_path (boinc-dl's settings) is not readable by the web server: "
                . "give it the web server's group, mode 0640 (see docs/boinc.md)");
        }
        $yaml_url = bdl_yaml_scalar(file_get_contents($yaml_path), 'redis_url');
        $sources[] = $yaml_path;
    }
    $get = function ($env, $key) use ($ini) {
        $v = getenv($env);
        if ($v !== false && $v !== '') return $v;
        return isset($ini[$key]) && $ini[$key] !== '' ? $ini[$key] : null;
    };
    $url = getenv('BDL_REDIS_URL');
    if ($url === false || $url === '') $url = $yaml_url;
    if ($url === null || $url === '') $url = $get('BDL_REDIS_URL', 'redis_url');
    $password = $get('BDL_REDIS_PASSWORD', 'redis_password');
    $pw_file = $get('BDL_REDIS_PASSWORD_FILE', 'redis_password_file');
    if ($password === null && $pw_file !== null) {
        if (!is_readable($pw_file)) {
            throw new BdlRedisError("the Redis password file $pw_file is not readable by the web server");
        }
        $password = trim(file_get_contents($pw_file));
    }
    if ($url === null || $url === '') {
        throw new BdlRedisError("no Redis URL: neither BDL_REDIS_URL, nor redis_url in $yaml_path"
            . (file_exists($yaml_path) ? '' : ' (missing: run boinc-dl boinc install)') . ", nor in $path");
    }
    return array('url' => $url, 'password' => $password);
}

/**
 * A top-level scalar of a YAML mapping as PyYAML's safe_dump writes it (plain,
 * 'single-quoted' or "double-quoted"); null when absent or null.
 */
function bdl_yaml_scalar($text, $key) {
    if (!preg_match('/^' . preg_quote($key, '/') . ':[ \t]*(.*?)[ \t]*$/m', $text, $m)) return null;
    $v = $m[1];
    if ($v === '' || $v === 'null' || $v === '~') return null;
    if ($v[0] === "'" && substr($v, -1) === "'") return str_replace("''", "'", substr($v, 1, -1));
    if ($v[0] === '"' && substr($v, -1) === '"') {
        $d = json_decode($v);
        return is_string($d) ? $d : null;
    }
    $hash = strpos($v, ' #');
    return $hash === false ? $v : rtrim(substr($v, 0, $hash));
}

// ---- data ------------------------------------------------------------------------------

/** Escape for HTML text and attribute values. */
function bdl_h($s) {
    return htmlspecialchars((string)$s, ENT_QUOTES | ENT_SUBSTITUTE, 'UTF-8');
}

function bdl_glob_escape($s) {
    return preg_replace('/([*?\[\]\\\\])/', '\\\\$1', $s);
}

function bdl_json($s) {
    $d = json_decode((string)$s, true);
    return is_array($d) ? $d : array();
}

/** Everything the page shows about one job. */
function bdl_load_job($r, $job) {
    $ns = 'bdl:' . $job;
    $meta = $r->hgetall("$ns:meta");
    $epochs = array();
    foreach ($r->hgetall("$ns:epochs") as $e => $json) {
        $epochs[(int)$e] = array('summary' => bdl_json($json), 'counts' => array());
    }
    $prefix = "$ns:epoch:";
    foreach ($r->scan_keys(bdl_glob_escape($prefix) . '*') as $key) {
        $e = substr($key, strlen($prefix));
        if (!ctype_digit($e)) continue;
        if (!isset($epochs[(int)$e])) $epochs[(int)$e] = array('summary' => array(), 'counts' => array());
        $epochs[(int)$e]['counts'] = $r->hgetall($key);
    }
    ksort($epochs);
    // unit states (server/common/store.py): created (not yet handed to the job
    // system), in_progress, assimilated, failed, cancelled
    $states = array('created' => 0, 'in_progress' => 0, 'assimilated' => 0, 'failed' => 0, 'cancelled' => 0);
    foreach ($r->hgetall("$ns:unit_state") as $unit => $state) {
        if (!isset($states[$state])) $states[$state] = 0;
        $states[$state]++;
    }
    $counters = array();
    foreach ($r->hgetall("$ns:counters") as $k => $v) $counters[$k] = (int)$v;
    $rejections = array();
    $rows = $r->cmd('XREVRANGE', "$ns:rejections", '+', '-', 'COUNT', '20');
    foreach ((array)$rows as $row) {
        $fields = array();
        for ($i = 0; $i + 1 < count($row[1]); $i += 2) $fields[$row[1][$i]] = $row[1][$i + 1];
        $d = isset($fields['data']) ? bdl_json($fields['data']) : array();
        $d['id'] = $row[0];
        $rejections[] = $d;
    }
    $versions = array();
    foreach ($r->cmd('HKEYS', "$ns:fingerprints") as $model) {
        $versions[$model] = (int)$r->cmd('GET', "$ns:v:$model");
    }
    ksort($versions);
    return array('name' => $job, 'meta' => $meta, 'epochs' => $epochs, 'states' => $states,
                 'counters' => $counters, 'rejections' => $rejections, 'versions' => $versions,
                 'cost' => $r->hgetall("$ns:cost_summary"));
}

/** Names of all jobs (the bdl:jobs set), sorted. */
function bdl_jobs($r) {
    $jobs = $r->cmd('SMEMBERS', 'bdl:jobs');
    sort($jobs, SORT_STRING);
    return $jobs;
}

// ---- formatting ------------------------------------------------------------------------

function bdl_num($v, $digits = 4) {
    if ($v === null || $v === '' || !is_numeric($v)) return '&ndash;';
    return bdl_h(rtrim(rtrim(number_format((float)$v, $digits, '.', ''), '0'), '.'));
}

function bdl_counter($c, $name) {
    return isset($c[$name]) ? (int)$c[$name] : 0;
}

function bdl_time($t) {
    if ($t === null || $t === '' || !is_numeric($t)) return '&ndash;';
    return bdl_h(gmdate('Y-m-d H:i:s', (int)$t) . ' UTC');
}

function bdl_latest_epoch($job) {
    $last = null;
    foreach ($job['epochs'] as $e => $ep) {
        if (isset($ep['summary']['val_acc'])) $last = $e;
    }
    return $last;
}

// ---- rendering -------------------------------------------------------------------------

function bdl_style() {
    return '<style>
.bdl table{border-collapse:collapse;margin:.4em 0 1.2em 0;font-size:13px}
.bdl th,.bdl td{border:1px solid #c8ccd2;padding:3px 8px;text-align:right}
.bdl th{background:#eef1f5}
.bdl td.l,.bdl th.l{text-align:left}
.bdl .err{color:#a40000;background:#fdeaea;padding:6px;border:1px solid #e0a0a0}
.bdl .ok{color:#176b1d}.bdl .bad{color:#a40000}.bdl .warn{color:#9a6200}
.bdl h3{margin-top:1.4em}.bdl .muted{color:#666}
.bdl svg text{font-family:sans-serif;font-size:11px}
</style>';
}

function bdl_jobs_table($jobs, $selected) {
    $o = "<h3>Jobs</h3>\n<table id=\"bdl-jobs\"><tr><th class=l>job</th><th class=l>mode</th><th class=l>status</th>"
       . "<th>epochs</th><th>in flight</th><th>done</th><th>failed</th><th>re-issued / regenerated</th><th>rejected</th>"
       . "<th>val acc</th><th class=l>created</th></tr>\n";
    foreach ($jobs as $j) {
        $m = $j['meta'];
        $last = bdl_latest_epoch($j);
        $acc = $last === null ? null : $j['epochs'][$last]['summary']['val_acc'];
        $target = isset($m['epochs']) ? (int)$m['epochs'] : null;
        $ep = count(array_filter($j['epochs'], function ($e) { return !empty($e['summary']); }));
        $link = '?job=' . rawurlencode($j['name']);
        $name = bdl_h($j['name']);
        $o .= '<tr' . ($j['name'] === $selected ? ' style="background:#fffbe6"' : '') . '>'
            . "<td class=l><a href=\"" . bdl_h($link) . "\">$name</a></td>"
            . '<td class=l>' . bdl_h(isset($m['mode']) ? $m['mode'] : '?') . '</td>'
            . '<td class=l>' . bdl_h(isset($m['status']) ? $m['status'] : '?') . '</td>'
            . '<td>' . $ep . ($target ? ' / ' . $target : '') . '</td>'
            . '<td>' . ($j['states']['created'] + $j['states']['in_progress']) . '</td>'
            . '<td>' . $j['states']['assimilated'] . '</td>'
            . '<td>' . $j['states']['failed'] . '</td>'
            . '<td>' . bdl_counter($j['counters'], 'reissued') . ' / ' . bdl_counter($j['counters'], 'regenerated') . '</td>'
            . '<td>' . bdl_counter($j['counters'], 'rejected') . '</td>'
            . '<td>' . bdl_num($acc) . '</td>'
            . '<td class=l>' . bdl_time(isset($m['created_at']) ? $m['created_at'] : null) . "</td></tr>\n";
    }
    if (!$jobs) $o .= '<tr><td class="l muted" colspan=11>no jobs in Redis</td></tr>' . "\n";
    return $o . "</table>\n";
}

/**
 * Learning curve as inline SVG: validation accuracy (left axis, 0..1), validation
 * loss (right axis), and the clients' mean validation accuracy +- one std as a band.
 */
function bdl_learning_curve_svg($epochs, $width = 640, $height = 280) {
    $pts = array();
    foreach ($epochs as $e => $ep) {
        $s = $ep['summary'];
        if (isset($s['val_acc']) || isset($s['val_loss']) || isset($s['client_val_acc_mean'])) $pts[$e] = $s;
    }
    if (!$pts) return '<p class=muted>No finished epoch yet: no learning curve.</p>';
    $ml = 46; $mr = 52; $mt = 14; $mb = 56;
    $pw = $width - $ml - $mr; $ph = $height - $mt - $mb;
    $emin = min(array_keys($pts)); $emax = max(array_keys($pts));
    $span = max(1, $emax - $emin);
    $lmax = 0.0;
    foreach ($pts as $s) {
        if (isset($s['val_loss']) && is_numeric($s['val_loss']) && is_finite((float)$s['val_loss'])) {
            $lmax = max($lmax, (float)$s['val_loss']);
        }
    }
    $lmax = $lmax > 0 ? $lmax * 1.1 : 1.0;
    $x = function ($e) use ($emin, $span, $ml, $pw) { return round($ml + ($e - $emin) / $span * $pw, 1); };
    $ya = function ($a) use ($mt, $ph) { return round($mt + (1 - max(0.0, min(1.0, (float)$a))) * $ph, 1); };
    $yl = function ($l) use ($mt, $ph, $lmax) { return round($mt + (1 - max(0.0, min(1.0, (float)$l / $lmax))) * $ph, 1); };
    $o = "<svg id=\"bdl-curve\" xmlns=\"http://www.w3.org/2000/svg\" width=\"$width\" height=\"$height\" "
       . "viewBox=\"0 0 $width $height\" role=\"img\" aria-label=\"learning curve\">\n"
       . "<rect x=\"$ml\" y=\"$mt\" width=\"$pw\" height=\"$ph\" fill=\"#fbfcfe\" stroke=\"#9aa3ad\"/>\n";
    for ($i = 0; $i <= 5; $i++) {
        $a = $i / 5; $yy = $ya($a);
        $o .= "<line x1=\"$ml\" x2=\"" . ($ml + $pw) . "\" y1=\"$yy\" y2=\"$yy\" stroke=\"#e3e7ec\"/>"
            . "<text x=\"" . ($ml - 5) . "\" y=\"" . ($yy + 4) . "\" text-anchor=\"end\" fill=\"#1f5fbf\">" . number_format($a, 1) . "</text>"
            . "<text x=\"" . ($ml + $pw + 5) . "\" y=\"" . ($yy + 4) . "\" fill=\"#c0392b\">" . bdl_h(round($lmax * $a, 3)) . "</text>\n";
    }
    $ticks = array_keys($pts);
    $step = max(1, (int)ceil(count($ticks) / 12));
    foreach ($ticks as $k => $e) {
        if ($k % $step !== 0 && $e !== $emax) continue;
        $o .= "<text x=\"" . $x($e) . "\" y=\"" . ($mt + $ph + 15) . "\" text-anchor=\"middle\">" . (int)$e . "</text>";
    }
    $o .= "<text x=\"" . ($ml + $pw / 2) . "\" y=\"" . ($mt + $ph + 30) . "\" text-anchor=\"middle\">epoch</text>\n";
    // clients' accuracy band (mean +- std)
    $upper = array(); $lower = array();
    foreach ($pts as $e => $s) {
        if (isset($s['client_val_acc_mean']) && is_numeric($s['client_val_acc_mean'])) {
            $sd = isset($s['client_val_acc_std']) && is_numeric($s['client_val_acc_std']) ? (float)$s['client_val_acc_std'] : 0.0;
            $upper[] = $x($e) . ',' . $ya((float)$s['client_val_acc_mean'] + $sd);
            $lower[] = $x($e) . ',' . $ya((float)$s['client_val_acc_mean'] - $sd);
        }
    }
    if ($upper) {
        $o .= '<polygon class="band" points="' . implode(' ', array_merge($upper, array_reverse($lower)))
            . "\" fill=\"#1f5fbf\" fill-opacity=\"0.15\" stroke=\"none\"/>\n";
    }
    $series = array(array('val_acc', $ya, '#1f5fbf', 'validation accuracy'),
                    array('val_loss', $yl, '#c0392b', 'validation loss'));
    foreach ($series as $sr) {
        list($key, $y, $color, $label) = $sr;
        $p = array(); $dots = '';
        foreach ($pts as $e => $s) {
            if (!isset($s[$key]) || !is_numeric($s[$key]) || !is_finite((float)$s[$key])) continue;
            $p[] = $x($e) . ',' . $y($s[$key]);
            $dots .= '<circle cx="' . $x($e) . '" cy="' . $y($s[$key]) . "\" r=\"3\" fill=\"$color\"><title>"
                   . bdl_h("epoch $e: $label " . $s[$key]) . "</title></circle>";
        }
        if ($p) {
            $o .= "<polyline class=\"$key\" points=\"" . implode(' ', $p) . "\" fill=\"none\" stroke=\"$color\" stroke-width=\"2\"/>$dots\n";
        }
    }
    // legend in one row under the plot, where no curve can hide it
    $o .= "<g transform=\"translate($ml," . ($height - 14) . ")\">"
        . "<line x1=\"0\" x2=\"18\" y1=\"-4\" y2=\"-4\" stroke=\"#1f5fbf\" stroke-width=\"2\"/><text x=\"24\" y=\"0\">validation accuracy</text>"
        . "<line x1=\"150\" x2=\"168\" y1=\"-4\" y2=\"-4\" stroke=\"#c0392b\" stroke-width=\"2\"/><text x=\"174\" y=\"0\">validation loss</text>"
        . "<rect x=\"280\" y=\"-8\" width=\"18\" height=\"8\" fill=\"#1f5fbf\" fill-opacity=\"0.15\"/><text x=\"304\" y=\"0\">clients' accuracy &#177; std</text>"
        . "</g>\n</svg>\n";
    return $o;
}

function bdl_job_detail($j) {
    $name = bdl_h($j['name']);
    $o = "<h3 id=\"bdl-job\">Job <code>$name</code></h3>\n";
    $meta = $j['meta'];
    ksort($meta);
    $o .= "<table id=\"bdl-meta\">";
    foreach ($meta as $k => $v) {
        // every time stamp (created_at, finished_at, ...) in UTC, not raw epoch seconds
        if (substr($k, -3) === '_at' && is_numeric($v)) $v = gmdate('Y-m-d H:i:s', (int)$v) . ' UTC';
        $o .= '<tr><th class=l>' . bdl_h($k) . '</th><td class=l>' . bdl_h($v) . "</td></tr>";
    }
    foreach ($j['versions'] as $m => $v) {
        $o .= '<tr><th class=l>weights version, model ' . bdl_h($m) . "</th><td class=l>$v</td></tr>";
    }
    $o .= "</table>\n";

    $st = $j['states'];
    $c = $j['counters'];
    $o .= "<h4>Workunits</h4>\n<table id=\"bdl-units\"><tr><th>queued</th><th>in flight</th><th>done</th><th>failed</th>"
        . "<th>re-issued (same inputs)</th><th>regenerated (fresh weights)</th><th>workunits cancelled</th>"
        . "<th>late calls of superseded workunits</th><th>rejected results</th><th>units cancelled</th></tr><tr>"
        . '<td>' . $st['created'] . '</td><td>' . $st['in_progress'] . '</td><td class=ok>' . $st['assimilated'] . '</td>'
        . '<td class="' . ($st['failed'] ? 'bad' : '') . '">' . $st['failed'] . '</td>'
        . '<td>' . bdl_counter($c, 'reissued') . '</td>'
        . '<td>' . bdl_counter($c, 'regenerated') . '</td>'
        . '<td>' . bdl_counter($c, 'boinc_cancelled') . '</td>'
        . '<td>' . bdl_counter($c, 'boinc_superseded_calls') . '</td>'
        . '<td class="' . (!empty($c['rejected']) ? 'warn' : '') . '">' . bdl_counter($c, 'rejected') . '</td>'
        . '<td>' . $st['cancelled'] . "</td></tr></table>\n";
    $extra = array_diff_key($c, array('reissued' => 1, 'regenerated' => 1, 'rejected' => 1,
                                      'boinc_cancelled' => 1, 'boinc_superseded_calls' => 1));
    if ($extra) {
        ksort($extra);
        $o .= '<p class=muted>Other counters: ';
        $parts = array();
        foreach ($extra as $k => $v) $parts[] = bdl_h($k) . ' = ' . (int)$v;
        $o .= implode(', ', $parts) . "</p>\n";
    }

    $o .= bdl_cost_table($j['cost']);
    $o .= "<h4>Learning curve</h4>\n" . bdl_learning_curve_svg($j['epochs']);

    $o .= "<h4>Epochs</h4>\n<table id=\"bdl-epochs\"><tr><th>epoch</th><th>units created</th><th>assimilated</th>"
        . "<th>failed</th><th>in flight</th><th>val acc</th><th>val loss</th><th>clients' val acc</th><th class=l>started</th></tr>\n";
    foreach (array_reverse($j['epochs'], true) as $e => $ep) {
        $cn = $ep['counts'];
        $s = $ep['summary'];
        $created = isset($cn['created']) ? (int)$cn['created'] : 0;
        $done = isset($cn['assimilated']) ? (int)$cn['assimilated'] : 0;
        $failed = isset($cn['failed']) ? (int)$cn['failed'] : 0;
        $client = '&ndash;';
        if (isset($s['client_val_acc_mean'])) {
            $client = bdl_num($s['client_val_acc_mean']) . ' &#177; ' . bdl_num(isset($s['client_val_acc_std']) ? $s['client_val_acc_std'] : 0);
        }
        $o .= "<tr><td>" . (int)$e . "</td><td>$created</td><td>$done</td><td>$failed</td><td>"
            . max(0, $created - $done - $failed) . '</td><td>' . bdl_num(isset($s['val_acc']) ? $s['val_acc'] : null)
            . '</td><td>' . bdl_num(isset($s['val_loss']) ? $s['val_loss'] : null) . "</td><td>$client</td><td class=l>"
            . bdl_time(isset($cn['started_at']) ? $cn['started_at'] : null) . "</td></tr>\n";
    }
    if (!$j['epochs']) $o .= "<tr><td colspan=9 class=l>no epoch started yet</td></tr>\n";
    $o .= "</table>\n";

    $o .= "<h4>Recent validator rejections</h4>\n";
    if (!$j['rejections']) {
        return $o . "<p class=muted>None.</p>\n";
    }
    $o .= "<table id=\"bdl-rejections\"><tr><th class=l>time</th><th class=l>unit</th><th class=l>result</th><th class=l>reason</th></tr>\n";
    foreach ($j['rejections'] as $rj) {
        $o .= '<tr><td class=l>' . bdl_time(isset($rj['t']) ? $rj['t'] : null) . '</td>'
            . '<td class=l>' . bdl_h(isset($rj['unit']) ? $rj['unit'] : '') . '</td>'
            . '<td class=l>' . bdl_h(isset($rj['result']) ? $rj['result'] : '') . '</td>'
            . '<td class=l>' . bdl_h(isset($rj['reason']) ? $rj['reason'] : '') . "</td></tr>\n";
    }
    return $o . "</table>\n";
}

/** Cloud cost of the job (written by the fleet controller, server/fleet/cost.py). */
function bdl_cost_table($c) {
    if (!$c) return '';
    $g = function ($k) use ($c) { return isset($c[$k]) ? bdl_h($c[$k]) : '&ndash;'; };
    return "<h4>Cloud cost</h4>\n<table id=\"bdl-cost\"><tr><th>instance-hours</th><th>cost $</th>"
        . "<th>on-demand equivalent $</th><th>saved $</th><th>saved %</th><th>reclaims</th><th>lost hours</th>"
        . "<th>lost $</th></tr><tr><td>" . $g('instance_hours') . '</td><td>' . $g('total_usd') . '</td><td>'
        . $g('on_demand_usd') . '</td><td class=ok>' . $g('saving_usd') . '</td><td>' . $g('saving_pct')
        . '</td><td>' . $g('reclaims') . '</td><td>' . $g('lost_hours') . '</td><td>' . $g('lost_usd')
        . "</td></tr></table>\n";
}

/** The page body (without head/tail): jobs table and the selected job's details. */
function bdl_render_body($selected) {
    $o = bdl_style() . "<div class=\"bdl\">\n";
    try {
        $cfg = bdl_redis_config();
        $r = new BdlRedis($cfg['url'], $cfg['password']);
        $names = bdl_jobs($r);
        $jobs = array();
        foreach ($names as $n) $jobs[$n] = bdl_load_job($r, $n);
        if ($selected === null || !isset($jobs[$selected])) {
            $latest = null;
            foreach ($jobs as $n => $j) {
                $t = isset($j['meta']['created_at']) ? (float)$j['meta']['created_at'] : 0.0;
                if ($latest === null || $t >= $latest[1]) $latest = array($n, $t);
            }
            $unknown = $selected;
            $selected = $latest === null ? null : $latest[0];
            if ($unknown !== null) {
                $o .= '<p class=err>No job named <code>' . bdl_h($unknown) . "</code>.</p>\n";
            }
        }
        $o .= bdl_jobs_table(array_values($jobs), $selected);
        if ($selected !== null) $o .= bdl_job_detail($jobs[$selected]);
        $r->close();
    } catch (BdlRedisError $e) {
        $o .= '<p class=err>boinc-dl state unavailable: ' . bdl_h($e->getMessage()) . "</p>\n";
    }
    return $o . '<p class=muted>Generated ' . bdl_h(gmdate('Y-m-d H:i:s')) . " UTC from Redis.</p>\n</div>\n";
}

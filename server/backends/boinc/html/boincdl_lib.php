<?php
// boinc-dl admin page: Redis access, data loading and HTML/SVG rendering.
// Included by boincdl.php; requesting this file directly outputs nothing.
//
// Written for PHP 7.0 (the boinc-server-docker images run PHP 7.0 on Debian
// stretch) up to PHP 8.x. Redis is reached through the small RESP client below,
// over TCP or a Unix socket, or as a Redis Cluster (BdlRedisCluster), so the page
// needs no PHP extension: the stock BOINC server images do not ship phpredis, and
// their Debian release is archived.

/** Error raised for any Redis connection or protocol problem. */
class BdlRedisError extends Exception {}

/** An error reply from Redis; $reply is its text without the leading '-'. */
class BdlRedisReplyError extends BdlRedisError {
    public $reply;

    public function __construct($reply) {
        parent::__construct('Redis: ' . $reply);
        $this->reply = $reply;
    }
}

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
            throw new BdlRedisReplyError($rest);
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

// ---- Redis Cluster -----------------------------------------------------------------------
//
// The daemons' store (server/assimilator/store.py, server/assimilator/connection.py) also runs on a
// Redis Cluster. Its URL is redis+cluster://[[user]:password@]host1:port1,host2:port2[/]
// or a comma-separated list of redis://[:password@]host:port URLs; there every key of
// job J is named bdl:{J}:... (the hash tag {J}: one slot) instead of bdl:J:...
//
// Routing: the client computes each key's slot (CRC16/XMODEM of its hash tag, mod
// 16384, as Redis does) and looks it up in the slot map that CLUSTER SLOTS gave at
// connect time. We chose that over "send anywhere and follow MOVED" because every
// command then goes straight to its master (following MOVED alone costs a wasted round
// trip for about two keys in three on 3 masters), because the map is the cluster's own
// list of its nodes (the only addresses a MOVED or ASK may send us to), and because the
// key-less SCAN of a job's epoch keys needs the master of the job's slot, which the map
// names. MOVED and ASK are still followed (a resharding under way): at most
// BdlRedisCluster::MAX_REDIRECTS per command, only to a syntactically valid host:port
// that the cluster lists, each node reached over one cached connection.

/** True when $url names a Redis Cluster rather than one server (cluster.is_cluster_url). */
function bdl_is_cluster_url($url) {
    return strpos($url, 'redis+cluster://') === 0
        || (strpos($url, ',') !== false && strpos($url, 'redis://') === 0);
}

/** A plausible host name or IP address: no scheme, path, port, space or control byte. */
function bdl_cluster_host_ok($host) {
    if (!is_string($host) || $host === '' || strlen($host) > 253) return false;
    if (filter_var($host, FILTER_VALIDATE_IP) !== false) return true;
    $label = '[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?';
    return (bool)preg_match('/^' . $label . '(?:\\.' . $label . ')*$/D', $host);
}

/** "host:port" ("[v6]:port"): a node's name in messages and connection URLs. */
function bdl_cluster_addr($host, $port) {
    return (strpos($host, ':') !== false ? '[' . $host . ']' : $host) . ':' . (int)$port;
}

/**
 * The startup nodes (array of array(host, port)) and password of a cluster URL, read
 * as server/assimilator/connection.py's cluster_nodes() reads it. Messages never quote the URL
 * (it may hold the password).
 */
function bdl_cluster_nodes($url) {
    $password = null;
    $parts = array();
    if (strpos($url, 'redis+cluster://') === 0) {
        $rest = substr($url, strlen('redis+cluster://'));
        $at = strrpos($rest, '@');
        if ($at !== false) {
            $cred = substr($rest, 0, $at);
            $rest = substr($rest, $at + 1);
            $colon = strpos($cred, ':');
            $pw = rawurldecode($colon === false ? $cred : substr($cred, $colon + 1));
            $password = $pw === '' ? null : $pw;
        }
        $slash = strpos($rest, '/');
        if ($slash !== false) $rest = substr($rest, 0, $slash);
        foreach (explode(',', $rest) as $p) {
            if ($p !== '') $parts[] = 'redis://' . $p;
        }
    } else {
        foreach (explode(',', $url) as $p) {
            $p = trim($p);
            if ($p !== '') $parts[] = $p;
        }
    }
    $nodes = array();
    foreach ($parts as $i => $p) {
        $u = parse_url($p);
        $host = is_array($u) && isset($u['host']) ? trim($u['host'], '[]') : '';
        $port = is_array($u) && isset($u['port']) ? (int)$u['port'] : 6379;
        if (!is_array($u) || !isset($u['scheme']) || $u['scheme'] !== 'redis' || !bdl_cluster_host_ok($host)
                || $port < 1 || $port > 65535) {
            throw new BdlRedisError('bad Redis Cluster node #' . ($i + 1) . ' in the Redis URL (expected host:port)');
        }
        $nodes[] = array($host, $port);
        if ($password === null && isset($u['pass']) && $u['pass'] !== '') $password = rawurldecode($u['pass']);
    }
    if (!$nodes) throw new BdlRedisError('no Redis Cluster nodes in the Redis URL');
    return array('nodes' => $nodes, 'password' => $password);
}

/** CRC16/XMODEM (polynomial 0x1021, initial value 0): Redis Cluster's key hash. */
function bdl_crc16($s) {
    static $table = null;
    if ($table === null) {
        $table = array();
        for ($i = 0; $i < 256; $i++) {
            $c = $i << 8;
            for ($j = 0; $j < 8; $j++) $c = (($c << 1) ^ (($c & 0x8000) ? 0x1021 : 0)) & 0xFFFF;
            $table[$i] = $c;
        }
    }
    $crc = 0;
    for ($i = 0, $n = strlen($s); $i < $n; $i++) {
        $crc = (($crc << 8) & 0xFFFF) ^ $table[(($crc >> 8) ^ ord($s[$i])) & 0xFF];
    }
    return $crc;
}

/** The slot of a key: its hash tag (the text between the first '{' and the next '}',
 *  when not empty) or else the whole key, hashed. */
function bdl_key_slot($key) {
    $s = strpos($key, '{');
    if ($s !== false) {
        $e = strpos($key, '}', $s + 1);
        if ($e !== false && $e > $s + 1) $key = substr($key, $s + 1, $e - $s - 1);
    }
    return bdl_crc16($key) & 16383;
}

/**
 * The admin page's reads on a Redis Cluster, with BdlRedis' interface: cmd() for the
 * keyed read commands (routed by their key's slot), hgetall(), scan_keys() on the
 * master of a given key's slot, close(). Each node is reached over one BdlRedis
 * connection, so its reply parsing applies to every node.
 */
class BdlRedisCluster {
    const SLOTS = 16384;
    const MAX_REDIRECTS = 5;
    const MAX_NODES = 1000;
    /** Commands whose first argument is their (only) key. */
    private static $keyed = array('GET' => true, 'HGETALL' => true, 'HKEYS' => true, 'HGET' => true, 'HLEN' => true,
                                  'SMEMBERS' => true, 'XREVRANGE' => true, 'EXISTS' => true, 'TYPE' => true);
    private $password;
    private $timeout;
    private $conns = array();   // address => BdlRedis
    private $known = array();   // address => array(host, port): the configured nodes and those the cluster lists
    private $ranges = array();  // array(first slot, last slot, address) for every range CLUSTER SLOTS gave
    private $moved = array();   // slot => address, from MOVED replies since the map was read

    /**
     * @param string $url  a cluster URL (bdl_cluster_nodes)
     * @param string|null $password  used when the URL carries none
     * @param float $timeout  connect and read timeout per node, seconds
     */
    public function __construct($url, $password = null, $timeout = 5.0) {
        $p = bdl_cluster_nodes($url);
        $this->password = $p['password'] !== null ? $p['password'] : $password;
        $this->timeout = $timeout;
        foreach ($p['nodes'] as $n) $this->known[bdl_cluster_addr($n[0], $n[1])] = $n;
        $errors = array();
        foreach ($p['nodes'] as $n) {
            $addr = bdl_cluster_addr($n[0], $n[1]);
            try {
                $this->read_slots($addr);
                return;
            } catch (BdlRedisError $e) {
                $this->drop($addr);
                $errors[] = "$addr: " . $e->getMessage();
            }
        }
        throw new BdlRedisError('no node of the Redis Cluster answered: ' . implode('; ', $errors));
    }

    /** Read the slot map (and so the list of nodes) from the node at $addr. */
    private function read_slots($addr) {
        $reply = $this->conn($addr)->cmd('CLUSTER', 'SLOTS');
        $bad = "Redis Cluster node $addr sent a malformed CLUSTER SLOTS reply";
        if (!is_array($reply) || count($reply) > self::SLOTS) throw new BdlRedisError($bad);
        $ranges = array();
        $known = array();
        foreach ($reply as $r) {
            if (!is_array($r) || count($r) < 3 || !is_int($r[0]) || !is_int($r[1]) || !is_array($r[2])
                    || count($r[2]) < 2 || $r[0] < 0 || $r[0] > $r[1] || $r[1] >= self::SLOTS) {
                throw new BdlRedisError($bad);
            }
            list($host, $port) = $r[2];
            // Redis 7: an empty or '?' endpoint means "the host you asked", on that port
            if ($host === null || $host === '' || $host === '?') $host = $this->known[$addr][0];
            if (!is_string($host) || !bdl_cluster_host_ok($host) || !is_int($port) || $port < 1 || $port > 65535) {
                throw new BdlRedisError("Redis Cluster node $addr lists a node with an invalid address");
            }
            $a = bdl_cluster_addr($host, $port);
            $known[$a] = array($host, $port);
            $ranges[] = array($r[0], $r[1], $a);
        }
        if (!$ranges) throw new BdlRedisError("Redis Cluster node $addr serves no slots (is the cluster created?)");
        if (count($known) > self::MAX_NODES) throw new BdlRedisError($bad);
        $this->ranges = $ranges;
        $this->moved = array();
        $this->known = array_merge($this->known, $known);
    }

    /** The connection to the node at $addr (one of $this->known), opened on first use. */
    private function conn($addr) {
        if (!isset($this->conns[$addr])) {
            $this->conns[$addr] = new BdlRedis('redis://' . $addr, $this->password, $this->timeout);
        }
        return $this->conns[$addr];
    }

    private function drop($addr) {
        if (isset($this->conns[$addr])) {
            $this->conns[$addr]->close();
            unset($this->conns[$addr]);
        }
    }

    /** The master serving $slot, as far as this client knows. */
    private function node_for($slot) {
        if (isset($this->moved[$slot])) return $this->moved[$slot];
        foreach ($this->ranges as $r) {
            if ($r[0] <= $slot && $slot <= $r[1]) return $r[2];
        }
        throw new BdlRedisError("no master of the Redis Cluster serves slot $slot");
    }

    /**
     * A MOVED or ASK reply as array(kind, slot, address); null for any other error.
     * The address must be a valid host:port (an empty host or '?': the replying host).
     */
    private function redirection($reply, $from) {
        if (!preg_match('/^(MOVED|ASK) ([0-9]{1,5}) (\S{1,300})$/D', $reply, $m)) return null;
        $colon = strrpos($m[3], ':');
        $host = $colon === false ? '' : trim(substr($m[3], 0, $colon), '[]');
        $port = $colon === false ? '' : substr($m[3], $colon + 1);
        if ($host === '' || $host === '?') $host = $this->known[$from][0];
        if ((int)$m[2] >= self::SLOTS || !ctype_digit($port) || strlen($port) > 5 || (int)$port < 1
                || (int)$port > 65535 || !bdl_cluster_host_ok($host)) {
            throw new BdlRedisError("Redis Cluster node $from redirected to an invalid address: " . substr($m[3], 0, 80));
        }
        return array($m[1], (int)$m[2], bdl_cluster_addr($host, (int)$port));
    }

    /** Run $args on the master of $slot, following MOVED and ASK. */
    private function run($slot, $args) {
        $addr = $this->node_for($slot);
        $asking = false;
        for ($hops = 0; ; $hops++) {
            try {
                $c = $this->conn($addr);
                if ($asking) $c->cmd('ASKING');
                return call_user_func_array(array($c, 'cmd'), $args);
            } catch (BdlRedisReplyError $e) {
                $to = $this->redirection($e->reply, $addr);
                if ($to === null) throw $e;
                list($kind, $to_slot, $target) = $to;
                if ($hops >= self::MAX_REDIRECTS) {
                    throw new BdlRedisError("Redis Cluster: $args[0] still redirected after " . self::MAX_REDIRECTS
                        . " redirections (the last one: $kind to $target)");
                }
                if (!isset($this->known[$target])) {
                    $this->read_slots($addr);  // a node added since: the cluster's own list, fresh
                    if (!isset($this->known[$target])) {
                        throw new BdlRedisError("Redis Cluster node $addr redirected to $target, a node the cluster does not list");
                    }
                }
                if ($kind === 'MOVED') $this->moved[$to_slot] = $target;
                $asking = $kind === 'ASK';
                $addr = $target;
            } catch (BdlRedisError $e) {
                // refused, lost or garbled: that connection is done (a reload starts afresh)
                $this->drop($addr);
                throw new BdlRedisError("Redis Cluster node $addr: " . $e->getMessage());
            }
        }
    }

    /** Send one keyed read command (see $keyed); it runs on the master of its key's slot. */
    public function cmd() {
        $args = func_get_args();
        $name = strtoupper((string)$args[0]);
        if (!isset(self::$keyed[$name]) || count($args) < 2) {
            throw new BdlRedisError("$name is not a command this Redis Cluster client routes");
        }
        return $this->run(bdl_key_slot((string)$args[1]), $args);
    }

    /** HGETALL as an associative array. */
    public function hgetall($key) {
        $flat = $this->cmd('HGETALL', $key);
        if (!is_array($flat) || count($flat) % 2) throw new BdlRedisError('Redis Cluster: malformed HGETALL reply');
        $out = array();
        for ($i = 0; $i + 1 < count($flat); $i += 2) {
            $out[(string)$flat[$i]] = $flat[$i + 1];
        }
        return $out;
    }

    /**
     * All keys matching a glob pattern in the slot of $route_key (SCAN is key-less: it
     * runs on that slot's master, confirmed first by a keyed command that follows MOVED).
     */
    public function scan_keys($pattern, $route_key) {
        $slot = bdl_key_slot($route_key);
        $this->cmd('EXISTS', $route_key);
        $cursor = '0';
        $keys = array();
        do {
            $r = $this->run($slot, array('SCAN', $cursor, 'MATCH', $pattern, 'COUNT', '1000'));
            if (!is_array($r) || count($r) !== 2 || !is_string($r[0]) || !ctype_digit($r[0]) || !is_array($r[1])) {
                throw new BdlRedisError('Redis Cluster: malformed SCAN reply');
            }
            $cursor = $r[0];
            foreach ($r[1] as $k) {
                if (is_string($k)) $keys[$k] = true;
            }
        } while ($cursor !== '0');
        return array_keys($keys);
    }

    public function close() {
        foreach (array_keys($this->conns) as $addr) $this->drop($addr);
    }
}

/** A client for the configured Redis: one server (BdlRedis) or a cluster (BdlRedisCluster). */
function bdl_connect($cfg) {
    if (bdl_is_cluster_url($cfg['url'])) return new BdlRedisCluster($cfg['url'], $cfg['password']);
    return new BdlRedis($cfg['url'], $cfg['password']);
}

// ---- configuration ---------------------------------------------------------------------

/**
 * Where Redis is, read like the daemons read it: BDL_REDIS_URL in the environment
 * (with BDL_REDIS_PASSWORD or BDL_REDIS_PASSWORD_FILE), else `redis_url` in the
 * project's boinc-dl.yaml (written by `boinc-dl boinc install`, two levels above
 * html/ops; BDL_SETTINGS names another file), else an ini file (BDL_ADMIN_CONFIG, or
 * boincdl.ini in the project directory: the docker stack) with keys redis_url,
 * redis_password, redis_password_file. No guess: without a URL the page says why.
 * The URL names one server or a Redis Cluster (bdl_is_cluster_url); a password
 * setting applies when the URL carries none.
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

/** The key prefix of a job: bdl:J on one server, bdl:{J} in a cluster (JobStore.ns). */
function bdl_job_ns($r, $job) {
    return $r instanceof BdlRedisCluster ? 'bdl:{' . $job . '}' : 'bdl:' . $job;
}

/** Everything the page shows about one job. */
function bdl_load_job($r, $job) {
    $ns = bdl_job_ns($r, $job);
    $meta = $r->hgetall("$ns:meta");
    $epochs = array();
    foreach ($r->hgetall("$ns:epochs") as $e => $json) {
        $epochs[(int)$e] = array('summary' => bdl_json($json), 'counts' => array());
    }
    $prefix = "$ns:epoch:";
    $pattern = bdl_glob_escape($prefix) . '*';
    // in a cluster SCAN runs on one master: the one serving the job's slot
    $keys = $r instanceof BdlRedisCluster ? $r->scan_keys($pattern, "$ns:meta") : $r->scan_keys($pattern);
    foreach ($keys as $key) {
        $e = substr($key, strlen($prefix));
        if (!ctype_digit($e)) continue;
        if (!isset($epochs[(int)$e])) $epochs[(int)$e] = array('summary' => array(), 'counts' => array());
        $epochs[(int)$e]['counts'] = $r->hgetall($key);
    }
    ksort($epochs);
    // unit states (server/assimilator/store.py): created (not yet handed to the job
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
    // how each model's weights are cut into shards (JobStore.layout): {"n": params, "shards": S}
    $layout = array();
    foreach ($r->hgetall("$ns:layout") as $model => $json) $layout[$model] = bdl_json($json);
    // the held-out loss check (server/assimilator/losscheck.py): each model's hosts' loss
    // ledgers (BOINC host id -> balance) and the results judged against trusted results
    // from worse models (too little replication)
    $ledgers = array();
    foreach (array_keys($versions) as $model) {
        $b = array();
        foreach ($r->hgetall("$ns:losscheck:ledger:$model") as $h => $v) $b[$h] = (float)$v;
        if ($b) {
            arsort($b);
            $ledgers[$model] = $b;
        }
    }
    $stale = array();
    foreach ($r->hgetall("$ns:losscheck:stale") as $m => $v) $stale[$m] = (int)$v;
    $spec = bdl_json((string)$r->cmd('GET', "$ns:spec"));
    $v = (isset($spec['validation']) && is_array($spec['validation'])) ? $spec['validation'] : array();
    $ledger_limit = null;
    if ($ledgers && isset($v['loss_ledger_limit']) && is_numeric($v['loss_ledger_limit'])) {
        $ledger_limit = (float)$v['loss_ledger_limit'];
    }
    // how many trusted (replicated) results the check has measured of those it needs
    // before it refuses anything (losscheck.enabled and trusted_needed: VC-ASGD on BOINC,
    // min(loss_check_min_trusted, the window of 32); the spec's defaults where it is silent)
    $check = null;
    if (isset($meta['backend']) && $meta['backend'] === 'boinc' && isset($spec['mode']) && $spec['mode'] === 'vcasgd'
        && (!isset($v['loss_check']) || $v['loss_check'] === true)) {
        $min = (isset($v['loss_check_min_trusted']) && is_int($v['loss_check_min_trusted'])) ? $v['loss_check_min_trusted'] : 16;
        $check = array('trusted' => (int)$r->cmd('LLEN', "$ns:trusted:loss_increase:0"), 'needed' => min(max($min, 1), 32));
    }
    // BOINC's records (server/backends/boinc/registry.py): late results the validator left
    // unchecked, and the replica comparisons of min_quorum >= 2 (each pair once)
    $late = (int)$r->cmd('HLEN', "$ns:boinc:late_results");
    // units the work generator replicated for the loss check (spotcheck.py), by why
    $spots = array();
    foreach ($r->hgetall("$ns:boinc:spot_checks") as $u => $json) {
        $c = bdl_json($json);
        $why = (isset($c['why']) && is_string($c['why'])) ? $c['why'] : '?';
        $spots[$why] = (isset($spots[$why]) ? $spots[$why] : 0) + 1;
    }
    $quorum = array();
    foreach ($r->hgetall("$ns:boinc:quorum") as $k => $v) $quorum[$k] = (int)$v;
    // MOP (server/work_generator/mop/state.py): each model's configuration and its
    // end-of-epoch results, also those of epochs not yet closed for every model
    $configs = array();
    $model_results = array();
    if (isset($meta['mode']) && $meta['mode'] === 'mop') {
        foreach ($r->hgetall("$ns:configs") as $model => $json) $configs[$model] = bdl_json($json);
        foreach ($r->hgetall("$ns:mop_model_results") as $key => $json) {
            $parts = explode(':', $key, 2);
            if (count($parts) !== 2 || !ctype_digit($parts[0])) continue;
            $model_results[$parts[1]][(int)$parts[0]] = bdl_json($json);
        }
        foreach ($r->hgetall("$ns:mop_results") as $e => $json) {
            if (!ctype_digit((string)$e)) continue;
            foreach (bdl_json($json) as $model => $res) {
                if (is_array($res)) $model_results[$model][(int)$e] = $res;
            }
        }
        foreach ($model_results as $m => $rows) ksort($model_results[$m]);
    }
    return array('name' => $job, 'meta' => $meta, 'epochs' => $epochs, 'states' => $states,
                 'counters' => $counters, 'rejections' => $rejections, 'versions' => $versions,
                 'layout' => $layout, 'late' => $late, 'quorum' => $quorum,
                 'ledgers' => $ledgers, 'ledger_limit' => $ledger_limit, 'loss_checks_stale' => $stale,
                 'spot_checks' => $spots, 'loss_check' => $check,
                 'configs' => $configs, 'model_results' => $model_results,
                 // the fleet controller writes bdl:J:cost_summary under that name on
                 // a cluster too (server/fleet/cost.py): a key of its own slot there
                 'cost' => $r->hgetall('bdl:' . $job . ':cost_summary'));
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
    $mop = isset($meta['mode']) && $meta['mode'] === 'mop';
    $o .= "<table id=\"bdl-meta\">";
    foreach ($meta as $k => $v) {
        // every time stamp (created_at, finished_at, ...) in UTC, not raw epoch seconds
        if (substr($k, -3) === '_at' && is_numeric($v)) $v = gmdate('Y-m-d H:i:s', (int)$v) . ' UTC';
        $o .= '<tr><th class=l>' . bdl_meta_label($k, $mop) . '</th><td class=l>' . bdl_h($v) . "</td></tr>";
    }
    foreach ($j['versions'] as $m => $v) {
        $name = bdl_model_label($j, $m);
        $shards = isset($j['layout'][$m]['shards']) ? (int)$j['layout'][$m]['shards'] : null;
        $o .= '<tr><th class=l>weights of model ' . $name . "</th><td class=l>version $v"
            . ($shards !== null ? ", stored as $shards Redis shard" . ($shards === 1 ? '' : 's') : '') . "</td></tr>";
    }
    $o .= "</table>\n";

    $st = $j['states'];
    $c = $j['counters'];
    $o .= "<h4>Workunits</h4>\n<table id=\"bdl-units\"><tr><th>queued</th><th>in flight</th><th>done</th><th>failed</th>"
        . "<th>re-issued (same inputs)</th><th>regenerated (fresh weights)</th><th>workunits cancelled</th>"
        . "<th>late calls of superseded workunits</th><th>late results not checked</th><th>rejected results</th>"
        . "<th>units cancelled</th></tr><tr>"
        . '<td>' . $st['created'] . '</td><td>' . $st['in_progress'] . '</td><td class=ok>' . $st['assimilated'] . '</td>'
        . '<td class="' . ($st['failed'] ? 'bad' : '') . '">' . $st['failed'] . '</td>'
        . '<td>' . bdl_counter($c, 'reissued') . '</td>'
        . '<td>' . bdl_counter($c, 'regenerated') . '</td>'
        . '<td>' . bdl_counter($c, 'boinc_cancelled')
        // workunits the work generator found stuck (no host could take the replica BOINC needed)
        . (!empty($c['boinc_stuck']) ? ' (' . (int)$c['boinc_stuck'] . ' stuck)' : '') . '</td>'
        . '<td>' . bdl_counter($c, 'superseded_calls') . '</td>'
        . '<td>' . (int)$j['late'] . '</td>'
        . '<td class="' . (!empty($c['rejected']) ? 'warn' : '') . '">' . bdl_counter($c, 'rejected')
        // refused results whose unit another host computes again (validation.reissue_refused)
        . (!empty($c['reissued_refused']) ? ' (' . (int)$c['reissued_refused'] . ' run again)' : '') . '</td>'
        . '<td>' . $st['cancelled'] . "</td></tr></table>\n";
    $extra = array_diff_key($c, array('reissued' => 1, 'regenerated' => 1, 'rejected' => 1, 'reissued_refused' => 1,
                                      'boinc_cancelled' => 1, 'boinc_stuck' => 1, 'superseded_calls' => 1));
    if ($extra) {
        ksort($extra);
        $o .= '<p class=muted>Other counters: ';
        $parts = array();
        foreach ($extra as $k => $v) $parts[] = bdl_h($k) . ' = ' . (int)$v;
        $o .= implode(', ', $parts) . "</p>\n";
    }

    $o .= bdl_quorum_table($j['quorum']);
    $o .= bdl_loss_check_section($j);
    $o .= bdl_cost_table($j['cost']);
    if ($mop) {
        $o .= "<h4>Models</h4>\n" . bdl_models_table($j);
        $o .= "<h4>Learning curves</h4>\n" . bdl_model_curves_svg($j);
    } else {
        $o .= "<h4>Learning curve</h4>\n" . bdl_learning_curve_svg($j['epochs']);
    }

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

/** The label of a job metadata key: one word for one thing (data subsets are not weight shards). */
function bdl_meta_label($k, $mop) {
    if ($k === 'n_shards') {
        return ($mop ? 'data partitions' : 'data subsets') . ' <span class=muted>(n_shards)</span>';
    }
    return bdl_h($k);
}

/** A model's name for people: its MOP hyper-parameters, with the id as a tooltip. */
function bdl_model_label($j, $m) {
    $cfg = isset($j['configs'][$m]) ? $j['configs'][$m] : null;
    if (!$cfg || empty($cfg['params']) || !is_array($cfg['params'])) return '<code>' . bdl_h($m) . '</code>';
    return '<span title="' . bdl_h($m) . '">' . bdl_h(bdl_params_text($cfg['params'])) . '</span>';
}

function bdl_params_text($params) {
    $parts = array();
    foreach ($params as $k => $v) {
        if (is_array($v)) $v = json_encode($v);
        elseif (is_bool($v)) $v = $v ? 'true' : 'false';
        $parts[] = "$k=$v";
    }
    return implode(', ', $parts);
}

/** The held-out loss check: results judged against trusted results from worse models,
 * and the hosts' ledgers nearest their limit (docs/merge-rules.md). Empty without either. */
function bdl_loss_check_section($j) {
    $stale = array_sum($j['loss_checks_stale']);
    $rows = array();
    foreach ($j['ledgers'] as $model => $hosts) {
        foreach ($hosts as $h => $b) {
            if ($b > 0) $rows[] = array($b, (string)$model, (string)$h);
        }
    }
    $spots = $j['spot_checks'];
    $check = $j['loss_check'];
    $inactive = $check !== null && $check['trusted'] < $check['needed'];
    if (!$stale && !$rows && !$spots && !$inactive) return '';
    $o = "<h4>Held-out loss check</h4>\n";
    if ($inactive) {
        $o .= '<p id="bdl-loss-inactive" class=warn>Not active yet: ' . (int)$check['trusted'] . ' of '
            . (int)$check['needed'] . " trusted (replicated) results measured; until then it refuses nothing.</p>\n";
    }
    if ($spots) {
        $n = array_sum($spots);
        $o .= '<p id="bdl-spot-checks">' . (int)$n . ' unit' . ($n === 1 ? '' : 's')
            . ' replicated on a second host for the check (spot checks): '
            . (int)(isset($spots['bootstrap']) ? $spots['bootstrap'] : 0) . ' until it had enough trusted results, '
            . (int)(isset($spots['stale']) ? $spots['stale'] : 0) . " after results judged against worse models.</p>\n";
    }
    if ($stale) {
        $o .= '<p id="bdl-loss-stale" class=warn>' . (int)$stale . ' result' . ($stale === 1 ? '' : 's')
            . ' judged against trusted results from worse models: replicate more (the work generator\'s'
            . " spot checks, the app's target_nresults at 2) so the check and the hosts' ledgers follow the model.</p>\n";
    }
    if ($rows) {
        usort($rows, function ($a, $b) { return $b[0] <=> $a[0]; });
        $lim = $j['ledger_limit'] === null ? '' : ' (refused past ' . bdl_h(rtrim(rtrim(number_format($j['ledger_limit'], 2), '0'), '.')) . ')';
        $o .= "<table id=\"bdl-ledgers\"><tr><th class=l>host</th><th>model</th><th>ledger balance$lim</th></tr>\n";
        foreach (array_slice($rows, 0, 10) as $row) {
            $o .= '<tr><td class=l>' . bdl_h($row[2]) . '</td><td>' . bdl_h($row[1]) . '</td><td>'
                . bdl_h(number_format($row[0], 2)) . "</td></tr>\n";
        }
        $o .= "</table>\n";
    }
    return $o;
}

/** min_quorum >= 2: how many replica comparisons were made across hosts and users. */
function bdl_quorum_table($q) {
    if (empty($q['comparisons'])) return '';
    $n = (int)$q['comparisons'];
    $pct = function ($k) use ($q, $n) {
        $v = isset($q[$k]) ? (int)$q[$k] : 0;
        return $v . ' <span class=muted>(' . number_format(100.0 * $v / $n, 1) . '%)</span>';
    };
    $same = isset($q['same_host']) ? (int)$q['same_host'] : 0;
    return "<h4>Replication</h4>\n<table id=\"bdl-quorum\"><tr><th>replica comparisons</th><th>across hosts</th>"
        . "<th>across users</th><th>same host</th><th>hosts unknown</th><th>matched</th></tr><tr>"
        . "<td>$n</td><td>" . $pct('across_hosts') . '</td><td>' . $pct('across_users') . '</td>'
        . '<td class="' . ($same ? 'bad' : '') . '">' . $pct('same_host') . '</td><td>' . $pct('hosts_unknown')
        . '</td><td>' . $pct('matched') . "</td></tr></table>\n"
        . ($same ? "<p class=warn>Some units were compared with a replica from the same host: set "
                   . "&lt;one_result_per_user_per_wu&gt; (boinc-dl boinc install --min-quorum 2 does).</p>\n" : '');
}

/** MOP: every model with its hyper-parameters, state and accuracy, best first: by the
 *  accuracy of the weights it keeps (its last epoch's), then its best epoch's, then epochs
 *  done, as `boinc-dl run`'s leaderboard ranks them (only the latest weights are kept). */
function bdl_models_table($j) {
    $rows = array();
    $models = array_unique(array_merge(array_keys($j['configs']), array_keys($j['model_results'])));
    foreach ($models as $m) {
        $cfg = isset($j['configs'][$m]) ? $j['configs'][$m] : array();
        $res = isset($j['model_results'][$m]) ? $j['model_results'][$m] : array();
        $best = null; $last = null; $last_e = null;
        foreach ($res as $e => $x) {
            if (!isset($x['val_acc']) || !is_numeric($x['val_acc'])) continue;
            $a = (float)$x['val_acc'];
            if ($best === null || $a > $best) $best = $a;
            if ($last_e === null || (int)$e > (int)$last_e) { $last = $a; $last_e = $e; }
        }
        $rows[] = array('m' => $m, 'cfg' => $cfg, 'best' => $best, 'last' => $last, 'last_e' => $last_e);
    }
    usort($rows, function ($a, $b) {
        foreach (array('last', 'best', 'last_e') as $k) {
            $x = $a[$k] === null ? -1.0 : (float)$a[$k];
            $y = $b[$k] === null ? -1.0 : (float)$b[$k];
            if ($x != $y) return $x < $y ? 1 : -1;
        }
        return strcmp($a['m'], $b['m']);
    });
    $o = "<table id=\"bdl-models\"><tr><th>#</th><th class=l>hyper-parameters</th><th class=l>model</th>"
       . "<th class=l>status</th><th>epochs done</th><th>val acc (last)</th><th>val acc (best)</th>"
       . "<th>weights version</th><th class=l>note</th></tr>\n";
    $rank = 0;
    foreach ($rows as $row) {
        $rank++;
        $cfg = $row['cfg'];
        $params = isset($cfg['params']) && is_array($cfg['params']) ? bdl_params_text($cfg['params']) : '';
        $note = isset($cfg['reason']) ? $cfg['reason'] : '';
        if (!empty($cfg['parent'])) $note = trim('from ' . $cfg['parent'] . ' ' . $note);
        $ver = isset($j['versions'][$row['m']]) ? (int)$j['versions'][$row['m']] : '&ndash;';
        $o .= '<tr' . ($rank === 1 && $row['best'] !== null ? ' class=ok' : '') . "><td>$rank</td>"
            . '<td class=l>' . bdl_h($params) . '</td><td class=l><code>' . bdl_h($row['m']) . '</code></td>'
            . '<td class=l>' . bdl_h(isset($cfg['status']) ? $cfg['status'] : '?') . '</td>'
            . '<td>' . ($row['last_e'] === null ? 0 : (int)$row['last_e']) . '</td>'
            . '<td>' . bdl_num($row['last']) . '</td><td>' . bdl_num($row['best']) . "</td><td>$ver</td>"
            . '<td class=l>' . bdl_h($note) . "</td></tr>\n";
    }
    if (!$rows) $o .= "<tr><td colspan=9 class=l>no model yet</td></tr>\n";
    return $o . "</table>\n";
}

/** MOP: one validation-accuracy curve per model, from each model's finished epochs. */
function bdl_model_curves_svg($j, $width = 640, $height = 280) {
    $series = array();
    foreach ($j['model_results'] as $m => $res) {
        $pts = array();
        foreach ($res as $e => $x) {
            if (isset($x['val_acc']) && is_numeric($x['val_acc'])) $pts[(int)$e] = (float)$x['val_acc'];
        }
        if ($pts) $series[$m] = $pts;
    }
    if (!$series) return '<p class=muted>No model has finished an epoch yet: no learning curve.</p>';
    $emax = 1;
    foreach ($series as $pts) $emax = max($emax, max(array_keys($pts)));
    $ml = 46; $mr = 16; $mt = 14; $mb = 36;
    $pw = $width - $ml - $mr; $ph = $height - $mt - $mb;
    // epoch 0 is the left edge, so a model with one finished epoch is a point, not the whole plot
    $x = function ($e) use ($emax, $ml, $pw) { return round($ml + $e / $emax * $pw, 1); };
    $y = function ($a) use ($mt, $ph) { return round($mt + (1 - max(0.0, min(1.0, $a))) * $ph, 1); };
    $palette = array('#1f5fbf', '#c0392b', '#27884a', '#8e44ad', '#d68910', '#138d90', '#7f8c8d', '#b03a78');
    $o = "<svg id=\"bdl-model-curves\" xmlns=\"http://www.w3.org/2000/svg\" width=\"$width\" height=\"$height\" "
       . "viewBox=\"0 0 $width $height\" role=\"img\" aria-label=\"learning curves per model\">\n"
       . "<rect x=\"$ml\" y=\"$mt\" width=\"$pw\" height=\"$ph\" fill=\"#fbfcfe\" stroke=\"#9aa3ad\"/>\n";
    for ($i = 0; $i <= 5; $i++) {
        $yy = $y($i / 5);
        $o .= "<line x1=\"$ml\" x2=\"" . ($ml + $pw) . "\" y1=\"$yy\" y2=\"$yy\" stroke=\"#e3e7ec\"/>"
            . "<text x=\"" . ($ml - 5) . "\" y=\"" . ($yy + 4) . "\" text-anchor=\"end\">" . number_format($i / 5, 1) . "</text>\n";
    }
    for ($e = 0; $e <= $emax; $e++) {
        $o .= "<text x=\"" . $x($e) . "\" y=\"" . ($mt + $ph + 15) . "\" text-anchor=\"middle\">$e</text>";
    }
    $o .= "<text x=\"" . ($ml + $pw / 2) . "\" y=\"" . ($mt + $ph + 30) . "\" text-anchor=\"middle\">epoch (validation accuracy)</text>\n";
    $k = 0;
    foreach ($series as $m => $pts) {
        ksort($pts);
        $color = $palette[$k++ % count($palette)];
        $label = isset($j['configs'][$m]['params']) && is_array($j['configs'][$m]['params'])
            ? bdl_params_text($j['configs'][$m]['params']) : $m;
        $p = array(); $dots = '';
        foreach ($pts as $e => $a) {
            $p[] = $x($e) . ',' . $y($a);
            $dots .= '<circle cx="' . $x($e) . '" cy="' . $y($a) . "\" r=\"3\" fill=\"$color\"><title>"
                   . bdl_h("$label, epoch $e: $a") . '</title></circle>';
        }
        $o .= '<g class="model"><title>' . bdl_h($label) . '</title>'
            . (count($p) > 1 ? '<polyline points="' . implode(' ', $p) . "\" fill=\"none\" stroke=\"$color\" stroke-width=\"2\"/>" : '')
            . "$dots</g>\n";
    }
    return $o . "</svg>\n";
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
        $r = bdl_connect($cfg);
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

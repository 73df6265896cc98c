<?php
// boinc-dl: training jobs, epochs, learning curves and workunit health, from Redis.
//
// Installed into a BOINC project's html/ops/ (with boincdl_lib.php beside it), it
// uses BOINC's admin page head/tail and the ops directory's access control. Run
// anywhere else (e.g. `php -S` in this folder) it renders a plain standalone page.
// Redis location: as the daemons read it, BDL_REDIS_URL in the environment, else
// redis_url in the project's boinc-dl.yaml (written by install); else boincdl.ini in
// the project directory (the docker stack, docs/docker.md). Never a guess. A Redis
// Cluster URL (redis+cluster://h1:p1,h2:p2/ or redis://h1:p1,redis://h2:p2) works there too.

$bdl_in_boinc = file_exists(__DIR__ . '/../inc/util_ops.inc');
if ($bdl_in_boinc) {
    require_once("../inc/util_ops.inc");
}
require_once(__DIR__ . '/boincdl_lib.php');

$bdl_title = 'boinc-dl training';
$bdl_job = isset($_GET['job']) && is_string($_GET['job']) ? $_GET['job'] : null;

if ($bdl_in_boinc && function_exists('admin_page_head')) {
    admin_page_head(bdl_h($bdl_title));
} else {
    header('Content-Type: text/html; charset=utf-8');
    echo "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        . '<title>' . bdl_h($bdl_title) . "</title>\n"
        . "<style>body{font-family:sans-serif;margin:1em 2em;color:#222}</style></head>\n<body>\n"
        . '<h2>' . bdl_h($bdl_title) . "</h2>\n";
}

echo bdl_render_body($bdl_job);

if ($bdl_in_boinc && function_exists('admin_page_tail')) {
    admin_page_tail();
} else {
    echo "</body></html>\n";
}

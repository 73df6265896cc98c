# boinc-dl on GCP: the server, a GPU and a CPU SPOT fleet, each with an on-demand twin
# group for the fleet controller's fallback. The controller runs on the server.

module "server" {
  source          = "../../gcp/server"
  name            = var.name
  project         = var.project
  region          = var.region
  zone            = var.zone
  source_repo     = var.source_repo
  source_ref      = var.source_ref
  admin_ssh_cidrs = var.admin_ssh_cidrs
}

module "gpu_fleet" {
  source               = "../../gcp/spot-fleet"
  name                 = "${var.name}-gpu-spot"
  on_demand_name       = "${var.name}-gpu-ondemand"
  project              = var.project
  zone                 = var.zone
  variant              = "gpu"
  machine_type         = var.gpu_machine_type
  image                = var.gpu_image
  project_url          = module.server.project_url
  weak_key_secret_id   = module.server.weak_key_secret_id
  controller_members   = ["serviceAccount:${module.server.service_account}"]
  boinc_dl_requirement = "boinc-dl[gpu]==${var.boinc_dl_version}"
}

module "cpu_fleet" {
  source               = "../../gcp/spot-fleet"
  name                 = "${var.name}-cpu-spot"
  on_demand_name       = "${var.name}-cpu-ondemand"
  project              = var.project
  zone                 = var.zone
  variant              = "cpu"
  machine_type         = var.cpu_machine_type
  image                = "ubuntu-os-cloud/ubuntu-2404-lts-amd64"
  boot_disk_gb         = 40
  project_url          = module.server.project_url
  weak_key_secret_id   = module.server.weak_key_secret_id
  controller_members   = ["serviceAccount:${module.server.service_account}"]
  boinc_dl_requirement = "boinc-dl[cpu]==${var.boinc_dl_version}"
}

variable "name" {
  description = "Name prefix of every resource (e.g. bdl)."
  type        = string
  default     = "bdl"
}

variable "project" {
  description = "GCP project id."
  type        = string
}

variable "region" {
  description = "Region of the server's static address."
  type        = string
}

variable "zone" {
  description = "Zone of the server VM and its data disk."
  type        = string
}

variable "network" {
  description = "VPC network self link or name."
  type        = string
  default     = "default"
}

variable "subnetwork" {
  description = "Subnetwork self link or name; null uses the network's auto subnet."
  type        = string
  default     = null
}

variable "image" {
  description = "Boot image: Ubuntu 24.04 LTS (docker.io and docker-compose-v2 in its archive)."
  type        = string
  default     = "ubuntu-os-cloud/ubuntu-2404-lts-amd64"
}

variable "machine_type" {
  description = "Machine type of the server VM."
  type        = string
  default     = "e2-standard-2"
}

variable "boot_disk_gb" {
  description = "Boot disk size in GiB."
  type        = number
  default     = 30
}

variable "data_disk_gb" {
  description = "Data disk size in GiB (docker volumes: project, database, Redis, spool)."
  type        = number
  default     = 200
}

variable "kms_key_self_link" {
  description = "Cloud KMS key for the disks (CMEK); null uses Google-managed encryption."
  type        = string
  default     = null
}

variable "http_cidrs" {
  description = "Source ranges allowed to reach HTTP (80) and HTTPS (443): the fleet and the browsers."
  type        = list(string)
  default     = ["0.0.0.0/0"]
}

variable "admin_ssh_cidrs" {
  description = "Source ranges allowed to SSH (22); empty (default) creates no SSH rule."
  type        = list(string)
  default     = []
}

variable "source_repo" {
  description = "Git URL of the boinc-dl source whose docker/ stack the server builds."
  type        = string
}

variable "source_ref" {
  description = "Tag or branch of source_repo to check out (pin a release tag)."
  type        = string
  default     = "v0.2.0"
}

variable "project_path" {
  description = "URL path of the BOINC project (the stack's PROJECT, default boincdl)."
  type        = string
  default     = "boincdl"
}

variable "labels" {
  description = "Labels added to every resource that takes them."
  type        = map(string)
  default     = {}
}

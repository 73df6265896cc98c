variable "name" {
  description = "Name prefix of every resource (e.g. bdl)."
  type        = string
  default     = "bdl"
}

variable "region" {
  description = "AWS region the server runs in (used by the VM to reach Secrets Manager)."
  type        = string
}

variable "vpc_id" {
  description = "VPC of the server's security group."
  type        = string
}

variable "subnet_id" {
  description = "Public subnet of the server VM; its availability zone also holds the data disk."
  type        = string
}

variable "ami_id" {
  description = "Ubuntu 24.04 LTS (or another image with docker.io and docker-compose-v2 in its archive)."
  type        = string
}

variable "instance_type" {
  description = "Instance type of the server VM (the BOINC stack, MariaDB and Redis)."
  type        = string
  default     = "m6i.large"
}

variable "root_volume_gb" {
  description = "Size of the encrypted root volume in GiB."
  type        = number
  default     = 30
}

variable "data_volume_gb" {
  description = "Size of the encrypted data volume (docker volumes: project, database, Redis, spool) in GiB."
  type        = number
  default     = 200
}

variable "kms_key_arn" {
  description = "Customer-managed KMS key for the volumes and secrets; null creates one (rotation on)."
  type        = string
  default     = null
}

variable "http_cidrs" {
  description = "CIDR blocks allowed to reach HTTP (80) and HTTPS (443): the fleet and the browsers."
  type        = list(string)
  default     = ["0.0.0.0/0"]
}

variable "admin_ssh_cidrs" {
  description = "CIDR blocks allowed to SSH (22); empty (default) opens no SSH (use SSM Session Manager)."
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

variable "tags" {
  description = "Tags added to every resource."
  type        = map(string)
  default     = {}
}
